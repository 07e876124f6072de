"""The chat template: conversations (system / user / assistant / tool turns) as token ids and a loss mask.

Contract: `ChatTemplate.encode` lays a conversation out as <bos>, the effort line, then each turn as its role
marker, its content and <|end|> (docs/chat_template.md has the layout and an example), and returns the ids and the
loss mask: each assistant turn's content and its closing <|end|>, nothing else. Every piece is encoded on its own,
so turn boundaries are exact and a content that spells a marker stays text. `prompt_ids` is the conversation so far
followed by <|assistant|>. A tokenizer lacking a token the template needs gets it appended on a private copy
(`ChatTemplate.vocab_size` then exceeds the original's). `check_sample` names what is wrong with a sample.

Design and reasoning: docs/data.md#the-chat-template-in-the-code
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer

from data.tokenizer import (
    ASSISTANT,
    BOS,
    BOS_NAMES,
    CHAT_TOKENS,
    EFFORT,
    END,
    EOS_NAMES,
    PAD,
    PAD_NAMES,
    SYSTEM,
    TOOL,
    USER,
    first_id,
)

__all__ = ["ROLES", "MAX_EFFORT", "ChatTemplate", "check_sample"]

ROLES = ("system", "user", "assistant", "tool")
_ROLE_TOKENS = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT, "tool": TOOL}
MIN_EFFORT, MAX_EFFORT = 1, 100
"""the reasoning effort's range; 100 (the most) is what a sample without an `effort` field gets"""


def _valid_effort(effort: object) -> bool:
    return isinstance(effort, int) and not isinstance(effort, bool) and MIN_EFFORT <= effort <= MAX_EFFORT


def check_sample(obj: object) -> str | None:
    """None when `obj` is a valid chat sample, else a one-line reason (one of a fixed set, so reasons can be counted).

    Valid: {"messages": [{"role": one of ROLES, "content": str}, ...], "effort": optional int 1..100}, with at least
    one message and at least one assistant turn. Other keys (of the sample or of a message) are ignored.
    """
    if not isinstance(obj, dict):
        return "not a JSON object"
    messages = obj.get("messages")
    if not isinstance(messages, list):
        return "'messages' missing or not a list"
    if not messages:
        return "'messages' is empty"
    for m in messages:
        if not isinstance(m, dict):
            return "a message is not an object"
        if m.get("role") not in ROLES:
            return "a message has no role among " + "/".join(ROLES)
        if not isinstance(m.get("content"), str):
            return "a message's content is not a string"
    if not any(m["role"] == "assistant" for m in messages):
        return "no assistant turn"
    if "effort" in obj and not _valid_effort(obj["effort"]):
        return f"'effort' is not an integer in {MIN_EFFORT}..{MAX_EFFORT}"
    return None


class ChatTemplate:
    """Encodes conversations for SFT (`encode`) and generation prompts for the RL engine (`prompt_ids`)."""

    def __init__(self, tokenizer: Tokenizer):
        # A private copy: the markers may have to be added, and content must be encoded with special-token matching
        # off; neither should change the caller's tokenizer.
        tok = Tokenizer.from_str(tokenizer.to_str())
        wanted = [(BOS, BOS_NAMES), (PAD, PAD_NAMES)] + [(t, (t,)) for t in CHAT_TOKENS]
        missing = [name for name, aliases in wanted if first_id(tok, aliases) is None]
        if missing:
            # add_special_tokens numbers new tokens after the highest id in use: the existing ids do not move.
            tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
        tok.encode_special_tokens = True  # content that spells "<|end|>" is text, not the marker
        self.tokenizer = tok
        self.added_tokens: tuple[str, ...] = tuple(missing)
        """the tokens this template appended to the tokenizer's vocabulary (empty for a tokenizer trained here)"""
        ids = {"bos": first_id(tok, BOS_NAMES), "pad": first_id(tok, PAD_NAMES)}
        eos = first_id(tok, EOS_NAMES)
        if eos is not None:
            ids["eos"] = eos
        ids.update({role: tok.token_to_id(t) for role, t in _ROLE_TOKENS.items()})
        ids.update(end=tok.token_to_id(END), effort=tok.token_to_id(EFFORT))
        self._ids: dict[str, int] = ids

    # -- ids ------------------------------------------------------------------------------------------------------

    @property
    def special_ids(self) -> dict[str, int]:
        """name -> id: bos, pad, eos (when the tokenizer has one), system, user, assistant, tool, end, effort"""
        return dict(self._ids)

    @property
    def bos_id(self) -> int:
        return self._ids["bos"]

    @property
    def pad_id(self) -> int:
        return self._ids["pad"]

    @property
    def end_id(self) -> int:
        """closes every turn; the stop token of generation"""
        return self._ids["end"]

    @property
    def vocab_size(self) -> int:
        """ids the template can emit (the added markers included): the model's vocab_size must be at least this"""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    # -- encoding -------------------------------------------------------------------------------------------------

    def _pieces(self, messages: list[dict], effort: int) -> list[list[int]]:
        """The token ids of the effort line and of each message's content, each piece encoded on its own."""
        if not _valid_effort(effort):
            raise ValueError(f"effort must be an integer in {MIN_EFFORT}..{MAX_EFFORT}, got {effort!r}")
        for m in messages:
            if m.get("role") not in ROLES:
                raise ValueError(f"message role must be one of {ROLES}, got {m.get('role')!r}")
        texts = [f"{effort}\n"] + [m["content"] for m in messages]
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def encode(self, messages: list[dict], effort: int = MAX_EFFORT) -> tuple[list[int], list[bool]]:
        """(ids, loss_mask) of a whole conversation; loss_mask[i] marks the ids the model is trained to produce
        (assistant content and the <|end|> closing it)."""
        effort_ids, *contents = self._pieces(messages, effort)
        ids = [self.bos_id, self._ids["effort"], *effort_ids]
        mask = [False] * len(ids)
        for m, content in zip(messages, contents):
            learn = m["role"] == "assistant"
            ids += [self._ids[m["role"]], *content, self.end_id]
            mask += [False] + [learn] * (len(content) + 1)
        return ids, mask

    def prompt_ids(self, messages: list[dict], effort: int = MAX_EFFORT) -> list[int]:
        """The conversation so far followed by <|assistant|>: what the model continues with an answer and <|end|>.
        A prefix of `encode(messages + [answer])`'s ids."""
        return self.encode(messages, effort)[0] + [self._ids["assistant"]]

    def render_prompt(self, user_text: str, effort: int = MAX_EFFORT, system: str | None = None) -> list[int]:
        """`prompt_ids` of a single user turn, after an optional system turn."""
        messages = [] if system is None else [{"role": "system", "content": system}]
        return self.prompt_ids(messages + [{"role": "user", "content": user_text}], effort)

    def decode_response(self, ids: list[int]) -> str:
        """The text of a generated answer: `ids` up to (without) its first <|end|>, special tokens dropped."""
        ids = list(ids)
        if self.end_id in ids:
            ids = ids[: ids.index(self.end_id)]
        return self.tokenizer.decode(ids, skip_special_tokens=True)
