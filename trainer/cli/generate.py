"""`python -m trainer.cli.generate ckpt=<checkpoint or run dir> prompt='<text>' max_new_tokens=<n>`: completions from a
checkpoint saved under any parallel layout, in one process, through the built-in engine (trainer/engine/).

Contract: `ckpt` (a checkpoint, or a run directory: its newest complete one) is verified and only its model part
read, under the config it records (`model.<key>=` changes only what a resume may); the tokenizer is `tokenizer=` or
the training run's. Prompts (`prompt=<text>` verbatim, or `prompts_file=<jsonl>` with the keys of `PROMPT_KEYS`)
are rendered with `prompt_template` and checked against `max_len` before the model is built; `stop` strings end a
completion before them; `drafter=<DSpark run>` decodes speculatively. Output: each completion on stdout (`shown`)
or one JSON object a line in `output=<path.jsonl>` (`_record`), in the prompts' order, then a throughput line.
Exit status: 0 done; 1 a request the engine refused (one line each, the others still reported); 2 a bad value,
file, checkpoint or prompt, or a Hydra refusal, in one line naming it.

Design and reasoning: docs/generation.md#command-line
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import torch

from config_checks import at_least, choice, choice_field, in_range, options, positive
from data.chat import ChatTemplate
from data.tokenizer import load_tokenizer, tokenizer_info
from model.config import ModelConfig
from trainer.checkpoint.loading import find_checkpoint, load_model, model_config, read_marker, run_tokenizer
from trainer.cli.app import device_named, io_message
from trainer.compose import CONF_DIR, check_config_groups, compose_node, hydra_overrides
from trainer.config import register_configs as register_train_configs
from trainer.engine import Completion, Engine, PromptFormat, Request, SamplingParams
from trainer.stages.dspark import load_drafter_weights
from trainer.threads import ThreadChoice, contention_hint, set_cpu_threads

_VERBATIM = ("prompt", "prompt_template")  # free text: quoted for Hydra by `_hydra_arguments`


@dataclass
class GenerateConfig:
    """The schema of conf/generate.yaml."""

    ckpt: str = ""
    """a checkpoint directory (<run dir>/checkpoints/step_<N>) or a run directory (its newest complete checkpoint)"""
    prompt: Optional[str] = None
    """the text to continue, verbatim; or prompts_file"""
    prompts_file: str = ""
    """a JSONL file of prompts, one JSON object a line (the module docstring lists the keys)"""
    output: str = ""
    """write the completions to this JSONL file instead of printing them"""
    tokenizer: str = ""
    """a tokenizer.json; "" = the training run's (its .hydra/config.yaml)"""
    max_new_tokens: int = 64
    temperature: float = 0.0
    """0 = greedy"""
    top_k: int = 0
    """0 = no cut"""
    top_p: float = 1.0
    """1 = no cut"""
    seed: int = 0
    """sampling seed; a prompts_file's prompts take seed + their index unless they set their own"""
    stop: List[str] = field(default_factory=list)
    """stop strings: a completion's text ends before the first one"""
    stop_token_ids: List[int] = field(default_factory=list)
    stop_at_eos: bool = True
    """the tokenizer's end-of-text token stops a completion"""
    stop_at_end: bool = True
    """with the default prompt_template (the chat template): <|end|>, which closes the assistant's turn, stops a
    completion (the SFT and RL stages train the model to end its answer with it)"""
    effort: int = 100
    """reasoning effort 1..100 (SPEC 2's API tiers max / high / low are 100 / 75 / 50)"""
    prompt_template: str = PromptFormat.template
    """how a prompt and its effort become the model's text ({prompt}, {effort}); '{prompt}' is the raw text"""
    max_batch: int = 32
    """requests decoded together"""
    cuda_graph: bool = False
    """capture the decode step in a CUDA graph (one process, a CUDA device): one launch a token"""
    max_len: int = 4096
    """longest prompt + max_new_tokens, in tokens"""
    replay: str = choice_field("halo", ("none", "window", "halo"))
    """the prefill's decoder bounded replay (model/cache.py): none (full depth), window, halo (exact)"""
    device: str = choice_field("auto", ("auto", "cpu", "cuda"))
    """auto: cuda when available, else cpu"""
    num_threads: int = 0
    """CPU threads; 0 = the cores this process may use (affinity, cgroup quota: trainer/threads.py)"""
    drafter: str = ""
    """a DSpark run (stage=dspark) trained on this model: speculative decoding with its drafter ("" = plain)"""
    spec_tokens: int = 0
    """with a drafter: the most drafts a step verifies (0 = its block size)"""
    spec_schedule: str = choice_field("auto", ("auto", "fixed"))
    """with a drafter: auto (each step's length from the confidences and the measured costs) or fixed"""
    model: Optional[ModelConfig] = None
    """null: the checkpoint's model config (`model=<option>` replaces it; see `model_config`)"""

    def __post_init__(self) -> None:
        if not self.ckpt:
            raise ValueError("ckpt is required: ckpt=<run dir>/checkpoints/step_<N>, or ckpt=<run dir> for its newest "
                             "checkpoint")
        if self.prompt is None and not self.prompts_file:
            raise ValueError("no prompt: give prompt=<text> or prompts_file=<jsonl>")
        if self.prompt is not None and self.prompts_file:
            raise ValueError("give prompt=<text> or prompts_file=<jsonl>, not both")
        if self.prompt == "":
            raise ValueError("prompt is empty: give the text to continue, prompt=<text>")
        positive("max_new_tokens", self.max_new_tokens)
        at_least("temperature", self.temperature, 0.0)
        at_least("top_k", self.top_k, 0)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        in_range("effort", self.effort, 1, 100)
        positive("max_batch", self.max_batch)
        positive("max_len", self.max_len)
        at_least("num_threads", self.num_threads, 0)
        at_least("spec_tokens", self.spec_tokens, 0)
        for name in ("replay", "device", "spec_schedule"):
            choice(name, getattr(self, name), options(self, name))
        if "{prompt}" not in self.prompt_template:
            raise ValueError(f"prompt_template={self.prompt_template!r} must contain {{prompt}}")
        try:
            PromptFormat(self.prompt_template).render("", self.effort)
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"prompt_template={self.prompt_template!r} may use only {{prompt}} and {{effort}} "
                             f"(write {{{{ and }}}} for braces): {e!r}") from None


def register_configs() -> None:
    """The schema as `generate_schema` (conf/generate.yaml's first default) and the groups' (`model/schema`)."""
    from hydra.core.config_store import ConfigStore

    register_train_configs()
    ConfigStore.instance().store(name="generate_schema", node=GenerateConfig)


def to_config(node) -> GenerateConfig:
    """The composed node as a validated GenerateConfig; ValueError (one line, naming the key) otherwise. As
    trainer/config.py `to_config` does, through a plain container (a `+key=` Hydra appended fails the merge), but
    one left unresolved: `to_object` resolves it, once (twice would make a prompt's escaped `\\${x}` interpolate)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        plain = OmegaConf.to_container(node, resolve=False)
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(GenerateConfig), plain))
    except OmegaConfBaseException as e:
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{first_line} (full key: {e.full_key})") from None


def compose(overrides: list[str]) -> GenerateConfig:
    """conf/generate.yaml with Hydra's override syntax, without Hydra's runner; ValueError (one line) for what Hydra
    refuses (trainer/compose.py)."""
    register_configs()
    return to_config(compose_node("generate", overrides))


# -- prompts -----------------------------------------------------------------------------------------------------------
@dataclass
class Prompt:
    """One prompt as given, before the tokenizer."""

    text: str
    where: str  # names it in messages: "prompt", "prompts_file='p.jsonl' line 3"
    request_id: object
    effort: int
    sampling: SamplingParams  # its stop_token_ids are the ones given; the EOS and stop-string tokens join later
    stop: list[str]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return _is_int(v) or isinstance(v, float)


PROMPT_KEYS = {
    "prompt": ("a string", lambda v: isinstance(v, str)),
    "id": ("any JSON value", lambda v: True),
    "effort": ("an integer", _is_int),
    "max_new_tokens": ("an integer", _is_int),
    "temperature": ("a number", _is_number),
    "top_k": ("an integer", _is_int),
    "top_p": ("a number", _is_number),
    "seed": ("an integer", _is_int),
    "stop": ("a string or a list of strings",
             lambda v: isinstance(v, str) or isinstance(v, list) and all(isinstance(s, str) for s in v)),
    "stop_token_ids": ("a list of integers", lambda v: isinstance(v, list) and all(_is_int(t) for t in v)),
}
"""the keys a prompts_file line may have: what each must be, and its check"""


def _prompt(given: dict, where: str, cfg: GenerateConfig, request_id, index: int) -> Prompt:
    """A Prompt from a prompts_file line (`given`) or the command line ({"prompt": ...}), defaults from `cfg`."""
    for key, value in given.items():
        if key not in PROMPT_KEYS:
            raise ValueError(f"{where}: unknown key {key!r} (a line may have {', '.join(PROMPT_KEYS)})")
        what, check = PROMPT_KEYS[key]
        if not check(value):
            raise ValueError(f"{where}: {key!r} must be {what}, got {json.dumps(value)}")
    if "prompt" not in given:
        raise ValueError(f"{where} has no \"prompt\"")
    if given["prompt"] == "":
        raise ValueError(f"{where}: the prompt is empty")
    in_range(f"{where}: effort", given.get("effort", cfg.effort), 1, 100)
    stop = given.get("stop", cfg.stop)
    try:
        sampling = SamplingParams(
            temperature=float(given.get("temperature", cfg.temperature)), top_k=given.get("top_k", cfg.top_k),
            top_p=float(given.get("top_p", cfg.top_p)), max_new_tokens=given.get("max_new_tokens", cfg.max_new_tokens),
            stop_token_ids=list(given.get("stop_token_ids", cfg.stop_token_ids)),
            seed=given.get("seed", cfg.seed + index))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return Prompt(given["prompt"], where, given.get("id", request_id), given.get("effort", cfg.effort), sampling,
                  [stop] if isinstance(stop, str) else list(stop))


def read_prompts(cfg: GenerateConfig) -> list[Prompt]:
    """The command line's prompt, or every non-blank line of prompts_file."""
    if cfg.prompt is not None:
        return [_prompt({"prompt": cfg.prompt}, "prompt", cfg, 1, 0)]
    name = f"prompts_file={cfg.prompts_file!r}"
    try:
        lines = Path(cfg.prompts_file).read_bytes().split(b"\n")
    except OSError as e:
        raise ValueError(f"{name} cannot be read ({e.strerror or e})") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{name} line {number}"
        try:
            given = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} is not valid JSON: {e.msg} (column {e.colno})") from None
        except ValueError as e:  # bytes that are not UTF-8
            raise ValueError(f"{where} is not valid JSON: {e}") from None
        if not isinstance(given, dict):
            raise ValueError(f"{where} is not a JSON object ({{\"prompt\": ...}})")
        prompts.append(_prompt(given, where, cfg, number, len(prompts)))
    if not prompts:
        raise ValueError(f"{name} holds no prompt")
    return prompts


def _stop_string_tokens(stop: list[str], tokenizer) -> list[int]:
    """The ids of the stop strings that are one token each (the engine stops on those; the others are cut after)."""
    out = []
    for s in stop:
        ids = tokenizer.encode(s).ids
        if len(ids) == 1 and tokenizer.decode(ids) == s:
            out.append(ids[0])
    return out


def chat_template(tokenizer, cfg: GenerateConfig):
    """The chat template (data/chat.py) when prompts are rendered with the default prompt_template, else None."""
    return ChatTemplate(tokenizer) if cfg.prompt_template == PromptFormat.template else None


def to_requests(prompts: list[Prompt], tokenizer, eos_id: int | None, cfg: GenerateConfig,
                template) -> list[Request]:
    """Each prompt rendered and tokenized; ValueError naming the first that does not fit max_len.

    With the default prompt_template a prompt is one user turn of the chat template, encoded as the SFT and RL
    stages encode it (`ChatTemplate.render_prompt`: the markers are special tokens, a prompt that spells one is
    text), and <|end|> stops it (`stop_at_end`). Another template is rendered as text and tokenized whole.
    template: `chat_template(tokenizer, cfg)`."""
    fmt = PromptFormat(cfg.prompt_template)
    end = [template.end_id] if template is not None and cfg.stop_at_end else []
    requests = []
    for p in prompts:
        if template is not None:
            ids = template.render_prompt(p.text, p.effort)
        else:
            ids = tokenizer.encode(fmt.render(p.text, p.effort)).ids
        total = len(ids) + p.sampling.max_new_tokens
        if total > cfg.max_len:
            raise ValueError(f"{p.where}: {len(ids)} prompt tokens (rendered with prompt_template) + max_new_tokens="
                             f"{p.sampling.max_new_tokens} = {total} exceed max_len={cfg.max_len}: shorten the prompt, "
                             "lower max_new_tokens or raise max_len")
        stops = [*p.sampling.stop_token_ids, *([eos_id] if cfg.stop_at_eos and eos_id is not None else []), *end,
                 *_stop_string_tokens(p.stop, tokenizer)]
        sampling = dataclasses.replace(p.sampling, stop_token_ids=list(dict.fromkeys(stops)))
        requests.append(Request(ids, sampling, effort=p.effort, request_id=p.request_id))
    return requests


def cut_at_stop_strings(c: Completion, stop: list[str], tokenizer) -> None:
    """End `c` at the first token whose text completes one of `stop`; its text ends before the stop string."""
    def first(text: str) -> int:
        hits = [i for i in (text.find(s) for s in stop) if i >= 0]
        return min(hits) if hits else -1

    if not stop or c.error is not None or first(c.text) < 0:
        return
    lo, hi = 1, len(c.token_ids)  # the fewest tokens whose text holds a stop string
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if first(tokenizer.decode(c.token_ids[:mid])) >= 0 else (mid + 1, hi)
    text = tokenizer.decode(c.token_ids[:lo])
    c.token_ids, c.logprobs, c.model_logprobs = c.token_ids[:lo], c.logprobs[:lo], c.model_logprobs[:lo]
    c.text, c.finish_reason = text[:first(text)], "stop"


# -- the run -----------------------------------------------------------------------------------------------------------
def _record(c: Completion, p: Prompt) -> dict:
    """One line of `output`."""
    out = {"id": c.request_id, "prompt": p.text, "effort": c.effort, "text": c.text, "finish_reason": c.finish_reason,
           "num_prompt_tokens": len(c.prompt_ids), "token_ids": c.token_ids, "logprobs": c.logprobs,
           "model_logprobs": c.model_logprobs}
    if c.error is not None:
        out["error"] = c.error
    return out


def _throughput(stats: dict, completions: list[Completion], seconds: float) -> str:
    def rate(tokens, s):
        return f"{tokens / s:.1f}" if s > 0 else "-"

    generated = sum(len(c.token_ids) for c in completions)
    prefill, decode = stats["prefill_tokens"], stats["decode_tokens"]
    return (f"{len(completions)} completion(s), {generated} tokens in {seconds:.2f} s: {rate(generated, seconds)} "
            f"tokens/s (prefill {prefill} tokens at {rate(prefill, stats['prefill_s'])} tokens/s, decode {decode} at "
            f"{rate(decode, stats['decode_s'])} tokens/s"
            + (f"; speculative: {stats['tokens_per_forward']:.2f} tokens per model forward, {stats['accepted_tokens']} "
               f"of {stats['drafted_tokens']} drafts accepted" if stats.get("drafted_tokens") else "") + ")")


def generate(cfg: GenerateConfig, model_overrides: Sequence[str] = ()) -> int:
    """Everything `python -m trainer.cli.generate` does once its config is composed; returns the exit status.
    model_overrides: `model.<key>=<value>` for the checkpoint's config (given without `model=<option>`)."""
    threads = torch.get_num_threads()
    choice = set_cpu_threads(cfg.num_threads) if device_named(cfg.device).type == "cpu" else None
    try:
        return _generate(cfg, list(model_overrides), choice)
    finally:
        torch.set_num_threads(threads)  # a caller in the same process (a test) keeps its own


def _generate(cfg: GenerateConfig, model_overrides: list[str], threads: ThreadChoice | None) -> int:
    prompts = read_prompts(cfg)
    path = find_checkpoint(cfg.ckpt)
    marker = read_marker(path)
    model_cfg = model_config(marker.get("model"), cfg.model, model_overrides, path)
    tokenizer_path = cfg.tokenizer or run_tokenizer(path)
    tokenizer = load_tokenizer(tokenizer_path)
    info = tokenizer_info(tokenizer, tokenizer_path)
    template = chat_template(tokenizer, cfg)
    vocab = info.vocab_size if template is None else max(info.vocab_size, template.vocab_size)
    if vocab > model_cfg.vocab_size:
        raise ValueError(f"tokenizer {tokenizer_path} has {vocab} ids (chat markers included), more than the "
                         f"checkpoint's model.vocab_size={model_cfg.vocab_size}: give the tokenizer it was trained "
                         "with")
    requests = to_requests(prompts, tokenizer, info.eos_id, cfg, template)
    if template is not None:  # decodes the chat markers it may have appended to the tokenizer too
        tokenizer = template.tokenizer
    if cfg.output and not Path(cfg.output).resolve().parent.is_dir():
        raise ValueError(f"output={cfg.output!r}: directory {Path(cfg.output).resolve().parent} does not exist")
    if threads and (hint := contention_hint(threads, "num_threads")):  # after the checks: a bad input is one line
        print(f"warning: {hint}", file=sys.stderr, flush=True)
    model = load_model(path, model_cfg, device_named(cfg.device), tokenizer_path)
    spec = {}
    if cfg.drafter:
        try:
            drafter = load_drafter_weights(cfg.drafter, model_cfg, device_named(cfg.device))
        except ValueError as e:
            raise ValueError(f"drafter={cfg.drafter}: {e}") from None
        spec = dict(drafter=drafter, spec_tokens=cfg.spec_tokens or None, spec_schedule=cfg.spec_schedule)
    engine = Engine(model, max_batch=cfg.max_batch, max_len=cfg.max_len, replay=cfg.replay, tokenizer=tokenizer,
                    cuda_graph=cfg.cuda_graph, **spec)
    start = time.perf_counter()
    completions = engine.generate(requests)
    seconds = time.perf_counter() - start
    for c, p in zip(completions, prompts):
        cut_at_stop_strings(c, p.stop, tokenizer)
    if cfg.output:
        with open(cfg.output, "w", encoding="utf-8") as f:
            for c, p in zip(completions, prompts):
                f.write(json.dumps(_record(c, p), ensure_ascii=False) + "\n")
        print(f"wrote {len(completions)} completion(s) of checkpoint {path} to {cfg.output}")
    else:
        for c, p in zip(completions, prompts):
            if c.error is None:
                print(shown(c, p.text))
    failed = [c for c in completions if c.error is not None]
    for c in failed:
        print(f"error: {c.error}", file=sys.stderr)
    print(_throughput(engine.stats, [c for c in completions if c.error is None], seconds)
          + (f"; CPU {threads.describe()}" if threads else ""), flush=True)
    return 1 if failed else 0


# -- the command line --------------------------------------------------------------------------------------------------
def _hydra_quote(text: str) -> str:
    """`text` as a Hydra single-quoted string that composes back to `text` exactly: quotes and the backslashes
    before them or at the end escaped, `${` kept from interpolating."""
    text = re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", text)
    text = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", text)
    text = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, text)
    return f"'{text}'"


def shown(c, prompt: str) -> str:
    """A completion as printed: a header line (id, tokens, finish reason), then the prompt and the completion each
    under its own label line, so an answer is never read as the end of its prompt (`7+2` then `8`, not `7+28`)."""
    return (f"--- {c.request_id}: {len(c.token_ids)} tokens, {c.finish_reason}\n"
            f"[prompt]\n{prompt}\n[completion]\n{c.text}")


def _hydra_arguments(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the arguments for Hydra, the `model.<key>=` overrides kept for the checkpoint's config). The free-text keys
    (`_VERBATIM`) are quoted for Hydra, so `prompt=def f(x):` means that text. With a `model=<option>` Hydra composes
    the model overrides; without one the model section is null and they apply to the checkpoint's (`model_config`)."""
    args = []
    for a in argv:
        key, eq, value = a.partition("=")
        args.append(f"{key}={_hydra_quote(value)}" if eq and key in _VERBATIM else a)
    if any(re.match(r"^[+~]*model=", a) for a in args):
        return args, []
    mine = [a for a in args if re.match(r"^\+{0,2}model\.", a)]
    return [a for a in args if a not in mine], mine


def _fail(message: str, code: int) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)  # SystemExit passes through Hydra untouched: no traceback


def _run(dcfg, model_overrides: list[str]) -> None:
    try:
        code = generate(to_config(dcfg), model_overrides)
    except ValueError as e:
        _fail(str(e), 2)
    except OSError as e:  # a file the run needs or writes (the tokenizer, output)
        _fail(io_message(e), 2)
    if code:
        sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    import hydra

    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip() + "\n\nKeys (conf/generate.yaml):\n" + (CONF_DIR / "generate.yaml").read_text())
        return
    try:
        args, model_overrides = _hydra_arguments(argv)
        check_config_groups(args)
        overrides = hydra_overrides(args)
        if overrides is not None:  # Hydra's runner reports a bad override in a dozen lines: one line here instead
            compose(overrides)
    except ValueError as e:
        _fail(str(e), 2)
    register_configs()
    sys.argv = [sys.argv[0], *args]
    hydra.main(config_path=str(CONF_DIR), config_name="generate", version_base=None)(
        lambda dcfg: _run(dcfg, model_overrides))()


if __name__ == "__main__":
    main()
