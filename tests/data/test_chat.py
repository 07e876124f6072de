"""The chat template (data/chat.py, docs/chat_template.md).

Proves: a tokenizer trained here numbers <bos>, <eos>, <pad> then the chat markers 0 .. 8 and the template uses
them as is; a conversation decodes back to the documented layout exactly, and content that spells a marker stays
text; the loss mask covers exactly each assistant turn's content and its closing <|end|>; the generation prompt is
a prefix of the full conversation's ids and ends with <|assistant|>, decode_response stops at <|end|>; a tokenizer
lacking the markers (and <bos> / <pad>) gets them appended after its own ids, without changing the caller's
tokenizer or any existing id; check_sample accepts valid samples and names each kind of malformation.
"""

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from data.chat import ChatTemplate, check_sample
from data.tokenizer import CHAT_TOKENS, SPECIAL_TOKENS, train_tokenizer
from tests.data.synthetic import write_text_corpus

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "alpha beta? <|end|> naïve"},
    {"role": "assistant", "content": "gamma delta"},
    {"role": "tool", "content": "{\"ok\": true}"},
    {"role": "assistant", "content": "café 数据\n"},
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_tokenizer(write_text_corpus(tmp_path_factory.mktemp("corpus")), vocab_size=400)


def test_trained_tokenizer_ids_and_exact_layout(tok):
    t = ChatTemplate(tok)
    assert [tok.token_to_id(x) for x in SPECIAL_TOKENS] == list(range(9)) and t.added_tokens == ()
    assert t.special_ids == {"bos": 0, "eos": 1, "pad": 2, "system": 3, "user": 4, "assistant": 5, "tool": 6,
                             "end": 7, "effort": 8}
    assert (t.bos_id, t.pad_id, t.end_id, t.vocab_size) == (0, 2, 7, tok.get_vocab_size())
    ids, mask = t.encode(CONVERSATION, effort=30)
    assert len(ids) == len(mask)
    text = "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in CONVERSATION)
    assert t.tokenizer.decode(ids, skip_special_tokens=False) == "<bos><|effort|>30\n" + text
    # Marker ids occur only where the template put them: the "<|end|>" a user typed is text.
    assert ids.count(t.end_id) == len(CONVERSATION)
    assert [i for i in ids if i < len(SPECIAL_TOKENS)] == [0, 8, 3, 7, 4, 7, 5, 7, 6, 7, 5, 7]


def test_loss_mask_is_assistant_content_and_its_end(tok):
    t = ChatTemplate(tok)
    ids, mask = t.encode(CONVERSATION)
    expected, pos = [], 0
    head = [t.bos_id, t.special_ids["effort"]] + tok.encode("100\n", add_special_tokens=False).ids
    assert ids[: len(head)] == head
    expected += [False] * len(head)
    pos = len(head)
    for m in CONVERSATION:
        content = t.tokenizer.encode(m["content"], add_special_tokens=False).ids
        assert ids[pos] == t.special_ids[m["role"]] and ids[pos + 1 + len(content)] == t.end_id
        assert ids[pos + 1 : pos + 1 + len(content)] == content  # each piece encoded on its own
        expected += [False] + [m["role"] == "assistant"] * (len(content) + 1)
        pos += len(content) + 2
    assert pos == len(ids) and mask == expected
    learnt = [i for i, m in zip(ids, mask) if m]
    assert t.tokenizer.decode(learnt, skip_special_tokens=False) == "gamma delta<|end|>café 数据\n<|end|>"


def test_prompt_is_a_prefix_and_responses_stop_at_end(tok):
    t = ChatTemplate(tok)
    ids, _ = t.encode(CONVERSATION, effort=7)
    prompt = t.prompt_ids(CONVERSATION[:-1], effort=7)
    assert prompt[-1] == t.special_ids["assistant"] and ids[: len(prompt)] == prompt
    answer = ids[len(prompt) :]
    assert answer[-1] == t.end_id and t.decode_response(answer) == "café 数据\n"
    assert t.decode_response(answer[:-1]) == "café 数据\n"  # no <|end|> yet (cut by a length limit)
    assert t.decode_response(answer + [t.bos_id, 300]) == "café 数据\n"  # anything after the stop token is ignored
    assert t.render_prompt("hi", 50, system="Be brief.") == t.prompt_ids(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], 50)
    assert t.render_prompt("hi") == t.prompt_ids([{"role": "user", "content": "hi"}])
    for bad in (0, 101, 2.5, True):
        with pytest.raises(ValueError, match="effort"):
            t.encode(CONVERSATION, effort=bad)
    with pytest.raises(ValueError, match="role"):
        t.encode([{"role": "narrator", "content": "x"}])


def test_a_tokenizer_without_the_markers_gets_them_appended():
    words = {"[UNK]": 0, "hello": 1, "world": 2, "</s>": 3}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t = ChatTemplate(tok)
    assert t.added_tokens == ("<bos>", "<pad>", *CHAT_TOKENS)
    assert tok.get_vocab_size(with_added_tokens=True) == 4, "the caller's tokenizer is unchanged"
    assert t.vocab_size == 4 + 8 and sorted(t.special_ids.values()) == [3, *range(4, 12)]
    assert t.special_ids["eos"] == 3 and t.bos_id == 4 and t.pad_id == 5
    ids, mask = t.encode([{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}])
    assert ids == [t.bos_id, t.special_ids["effort"], 0, t.special_ids["user"], 1, t.end_id,
                   t.special_ids["assistant"], 2, t.end_id]  # "100\n" is unknown to this word-level vocabulary
    assert mask == [False] * 7 + [True, True]
    assert t.tokenizer.encode("hello world", add_special_tokens=False).ids == [1, 2], "existing ids unchanged"


GOOD = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "extra": 1}]}


@pytest.mark.parametrize("sample, reason", [
    ([GOOD], "not a JSON object"),
    ({"conversation": []}, "'messages' missing or not a list"),
    ({"messages": "hi"}, "'messages' missing or not a list"),
    ({"messages": []}, "'messages' is empty"),
    ({"messages": ["hi", {"role": "assistant", "content": "a"}]}, "a message is not an object"),
    ({"messages": [{"role": "bot", "content": "a"}]}, "a message has no role among system/user/assistant/tool"),
    ({"messages": [{"content": "a"}]}, "a message has no role among system/user/assistant/tool"),
    ({"messages": [{"role": "assistant", "content": None}]}, "a message's content is not a string"),
    ({"messages": [{"role": "assistant"}]}, "a message's content is not a string"),
    ({"messages": [{"role": "user", "content": "q"}]}, "no assistant turn"),
    ({**GOOD, "effort": 0}, "'effort' is not an integer in 1..100"),
    ({**GOOD, "effort": 101}, "'effort' is not an integer in 1..100"),
    ({**GOOD, "effort": "high"}, "'effort' is not an integer in 1..100"),
    ({**GOOD, "effort": True}, "'effort' is not an integer in 1..100"),
])
def test_check_sample_names_each_malformation(sample, reason):
    assert check_sample(sample) == reason


def test_check_sample_accepts_valid_samples():
    assert check_sample(GOOD) is None
    assert check_sample({**GOOD, "effort": 1}) is None and check_sample({**GOOD, "effort": 100}) is None
    assert check_sample({"messages": [{"role": "assistant", "content": ""}], "id": "x"}) is None
