"""Every entry point reports a bad override the same way: one `error: ...` line on stderr naming the key, a
misspelled key with the closest valid one (difflib), a value of the wrong type with its key, and exit status 2
(trainer/config.py `key_error_message`, trainer/compose.py `one_line`, `hydra_overrides`). Training's main (the
console script's entry function) composes before Hydra's runner, whose own report is a dozen lines and exit 1."""

import sys

import pytest

from trainer.cli import evaluate, export_hf, generate, import_hf, main, plan, preflight, report, stage_chain
from trainer.compose import hydra_overrides, sweep_variants


def _training_main(args):
    sys.argv = ["cedar-train", *args]
    main.main()


def _chain(args):
    sys.exit(stage_chain.main(["--root", "/nonexistent/pipeline", "--", *args]))


APPS = {
    "main": (_training_main, [], "trainer."),
    "plan": (plan.main, [], "trainer."),
    "preflight": (lambda a: preflight.main(["1", *a]), [], "trainer."),
    "stage_chain": (_chain, [], "trainer."),
    "generate": (generate.main, ["ckpt=/nonexistent"], ""),
    "export_hf": (export_hf.main, ["ckpt=/nonexistent", "out=/nonexistent"], ""),
    "import_hf": (import_hf.main, ["src=/nonexistent", "out=/nonexistent"], ""),
    "evaluate": (evaluate.main, ["ckpt=/nonexistent"], ""),
}
TYPO = {"trainer.": ("trainer.max_stpes=5", "unknown key trainer.max_stpes (did you mean trainer.max_steps?)"),
        "": ("chunk_mbb=5", "unknown key chunk_mbb (did you mean chunk_mb?)")}
WRONG_TYPE = {"trainer.": ("trainer.max_steps=abc", "trainer.max_steps: Value 'abc' of type 'str' could not be "
                                                     "converted to Integer"),
              "": ("chunk_mb=abc", "chunk_mb: Value 'abc' of type 'str' could not be converted to Integer")}


def _error(app, args, monkeypatch, capsys) -> str:
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    fn, base, _ = APPS[app]
    with pytest.raises(SystemExit) as e:
        fn([*base, *args])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("app", sorted(APPS))
@pytest.mark.parametrize("mistakes", [TYPO, WRONG_TYPE], ids=["typo", "wrong_type"])
def test_a_bad_override_is_one_line_and_exit_2(app, mistakes, monkeypatch, capsys):
    if app == "generate" and mistakes is TYPO:  # generate has no chunk_mb: its own key
        override, line = "max_new_tokenz=3", "unknown key max_new_tokenz (did you mean max_new_tokens?)"
    elif app == "generate":
        override, line = "max_new_tokens=abc", "max_new_tokens: Value 'abc' of type 'str' could not be converted to Integer"
    elif app == "evaluate" and mistakes is TYPO:  # nor has evaluate
        override, line = "max_tokenz=3", "unknown key max_tokenz (did you mean max_tokens?)"
    elif app == "evaluate":
        override, line = "max_tokens=abc", "max_tokens: Value 'abc' of type 'str' could not be converted to Integer"
    else:
        override, line = mistakes[APPS[app][2]]
    assert _error(app, [override], monkeypatch, capsys) == f"error: {line}"


def test_a_key_with_no_close_match_lists_its_section(monkeypatch, capsys):
    line = _error("plan", ["logger.zzzzzz=1"], monkeypatch, capsys)
    assert line.startswith("error: unknown key logger.zzzzzz; the keys of logger: ") and "log_every" in line


@pytest.mark.parametrize("args, line", [
    (["-m", "optim.lrr=1e-3,3e-3"], "error: unknown key optim.lrr (did you mean optim.lr?)"),
    (["-m", "optim.lr=1e-3,3e-3", "trainer.max_steps=1,abc"],
     "error: trainer.max_steps: Value 'abc' of type 'str' could not be converted to Integer"),
    (["--multirun", "model=v41_tiny,v41_tinny"], "error: model=v41_tinny: config group 'model' has no option "
                                                 "'v41_tinny' (did you mean v41_tiny?); options: v41_flash, v41_proxy, "
                                                 "v41_small, v41_tiny, v41_tiny_mm"),
])
def test_a_sweep_with_a_bad_value_is_one_line_before_its_first_job(args, line, monkeypatch, capsys):
    """Issue 44 re-run: `-m optim.lrr=1e-3,3e-3` was Hydra's eight lines and exit 1; every swept value is composed
    first (compose.sweep_variants)."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    with pytest.raises(SystemExit) as e:
        _training_main(args)
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [line]


def test_sweep_variants_take_every_swept_value_once():
    assert sweep_variants(["-m", "a=1,2", "b=3", "c=range(4,6)"]) == [["a=1", "b=3", "c=4"], ["a=2", "b=3", "c=4"],
                                                                       ["a=1", "b=3", "c=5"]]
    assert sweep_variants(["-m", "+a.b=x,y"]) == [["+a.b=x"], ["+a.b=y"]]
    # long sweeps: their first and last value; not a sweep, a glob, another primary config: none (Hydra's)
    assert sweep_variants(["-m", "a=range(0,100)"]) == [["a=0"], ["a=99"]]
    assert sweep_variants(["a=1,2"]) is None and sweep_variants(["-m", "model=glob(*)"]) is None
    assert sweep_variants(["-m", "--config-name=other", "a=1,2"]) is None


@pytest.mark.parametrize("argv, overrides", [
    (["--cfg", "job", "trainer.max_steps=3"], ["trainer.max_steps=3"]),
    (["a=1", "--resolve", "-c", "all", "b=2"], ["a=1", "b=2"]),
    (["-m", "trainer.max_steps=1,2"], None),
    (["--config-name=other", "a=1"], None),
])
def test_hydra_flags_are_not_overrides(argv, overrides):
    assert hydra_overrides(argv) == overrides


@pytest.mark.parametrize("name", ["plan", "preflight", "generate", "export_hf", "import_hf", "evaluate"])
def test_help_prints_the_usage_and_exits_0(name, monkeypatch, capsys):
    """`--help` is not taken for an override: each app prints its usage (the command line it documents) and ends."""
    apps = {"plan": plan.main, "preflight": preflight.main, "generate": generate.main, "export_hf": export_hf.main,
            "import_hf": import_hf.main, "evaluate": evaluate.main}
    apps[name](["--help"])
    out = capsys.readouterr()
    assert f"python -m trainer.cli.{name}" in out.out and out.err == ""


@pytest.mark.parametrize("app, args, line", [
    (stage_chain.main, ["--scale", "abc"], "error: argument --scale: invalid float value: 'abc' "
                                           "(python -m trainer.cli.stage_chain --help)"),
    (stage_chain.main, ["--rooot"], "error: unrecognized arguments: --rooot (python -m trainer.cli.stage_chain "
                                    "--help)"),
    (report.main, ["run", "--outt"], "error: unrecognized arguments: --outt (python -m trainer.cli.report --help)"),
])
def test_a_bad_option_of_the_apps_with_options_is_one_line(app, args, line, capsys):
    """stage_chain (`make pipeline PIPELINE_ARGS=...`) and report take options, not overrides: argparse's usage block
    and error (two lines or more) become one line, exit 2, as elsewhere."""
    with pytest.raises(SystemExit) as e:
        app(args)
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [line]



@pytest.mark.parametrize("name", ["generate", "evaluate"])
def test_a_missing_checkpoint_is_one_line_on_a_loaded_machine(name, monkeypatch, capsys):
    """The shared-machine warning (several threads, a load average above the cores) comes only once the inputs are
    checked: before, generate's missing checkpoint was that warning and then the error (issue 44, from a fresh
    clone). The torch thread count is the test's again afterwards (the app restores it)."""
    import os

    monkeypatch.setattr(os, "getloadavg", lambda: (4.0 * (os.cpu_count() or 1), 0.0, 0.0))
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    app, extra = {"generate": (generate.main, ["prompt=hi"]), "evaluate": (evaluate.main, [])}[name]
    with pytest.raises(SystemExit) as e:
        app(["ckpt=/nonexistent/run", "num_threads=2", "device=cpu", *extra])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == ["error: ckpt='/nonexistent/run' does not exist"]
