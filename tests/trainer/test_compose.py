"""trainer/compose.py: a config group option that does not exist is one line naming the group and its options
(without the `schema` node), the same line whether it is caught on the command line before Hydra runs
(`check_config_groups`, for `@hydra.main` entry points) or from Hydra's MissingConfigException (`trainer.compose.compose`);
a choice sweep and a nested group are checked too, and everything else is left to Hydra."""

import pytest

from trainer.compose import check_config_groups, unknown_option_message


@pytest.mark.parametrize("args, line", [
    (["model=v41_tinny"], "model=v41_tinny: config group 'model' has no option 'v41_tinny' (did you mean "
                          "v41_tiny?); options: v41_flash, v41_proxy, v41_small, v41_tiny, v41_tiny_mm"),
    (["trainer.max_steps=5", "parallel=nosuch"], "parallel=nosuch: config group 'parallel' has no option 'nosuch'; "
                                                 "options: default, flagship_256xh200"),
    (["-m", "model=v41_tiny,v41_smal"], "model=v41_smal: config group 'model' has no option 'v41_smal' (did you "
                                        "mean v41_small?); options: v41_flash, v41_proxy, v41_small, v41_tiny, "
                                        "v41_tiny_mm"),
    (["hydra/launcher=nosuch"], "hydra/launcher=nosuch: config group 'hydra/launcher' has no option 'nosuch'; "
                                "options: basic"),
])
def test_unknown_option_is_one_line(args, line):
    with pytest.raises(ValueError) as e:
        check_config_groups(args)
    assert str(e.value) == line


@pytest.mark.parametrize("args", [
    [], ["model=v41_tiny", "parallel=flagship_256xh200"], ["--cfg", "job", "trainer.max_steps=3"],
    ["-m", "model=v41_tiny,v41_small"], ["hydra.run.dir=runs/x", "model.dim=64"], ["~model"], ["model=glob(*)"],
    ["modle=v41_tiny"],  # no such group: Hydra's own "Could not override 'modle'" names it
    ["model=[v41_tiny"],  # a syntax error: Hydra's grammar error names it
])
def test_what_exists_or_is_not_a_selection_passes(args):
    check_config_groups(args)


def test_same_line_as_the_planner():
    from trainer.compose import compose

    with pytest.raises(ValueError) as planned:
        compose(["model=v41_tinny"])
    with pytest.raises(ValueError) as checked:
        check_config_groups(["model=v41_tinny"])
    assert str(planned.value) == str(checked.value)


def test_schema_is_not_offered():
    assert unknown_option_message("optim", "adam", ["adamw", "adamw_wsd", "schema"]) == (
        "optim=adam: config group 'optim' has no option 'adam' (did you mean adamw?); options: adamw, adamw_wsd")
