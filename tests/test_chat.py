"""dsv32_jax.posttrain.chat: the DeepSeek-V3.2 chat encoding. Golden strings are written by hand from the format (the package
docstring, dsv32_jax/posttrain/chat/__init__.py), not copied from the encoder; masks are checked by decoding the masked tokens;
data (system, user, tool results, schemas, assistant text) is plain text in both codecs."""

import json

import pytest

from dsv32_jax.posttrain import chat
from dsv32_jax.posttrain.chat import Assistant, ChatFormatError, System, Tool, ToolCall, ToolResult, User

B, E = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A = "<｜User｜>", "<｜Assistant｜>"


def calls_block(*invokes: str) -> str:
    """Hand-written DSML: invokes are given as (name, [(key, string-flag, raw value), ...]) pre-rendered lines."""
    return "\n\n<｜DSML｜function_calls>\n" + "\n".join(invokes) + "\n</｜DSML｜function_calls>"


def invoke(name: str, *params: tuple[str, str, str]) -> str:
    body = "\n".join(f'<｜DSML｜parameter name="{k}" string="{s}">{v}</｜DSML｜parameter>' for k, s, v in params)
    return f'<｜DSML｜invoke name="{name}">\n{body}\n</｜DSML｜invoke>'


CALL1 = calls_block(invoke("calc", ("expr", "true", "3*4")))
CALL2 = calls_block(invoke("calc", ("expr", "true", "2+12"), ("digits", "false", "0")))
RES12 = "\n\n<function_results>\n<result>12</result>\n</function_results>\n\n"
RES14 = "\n\n<function_results>\n<result>14</result>\n</function_results>\n\n"


def episode() -> list:
    """user -> reasoning + call -> result -> reasoning + call -> result -> reasoning + answer."""
    return [
        User("what is 2+3*4?"),
        Assistant(reasoning="use calc", tool_calls=[ToolCall("calc", {"expr": "3*4"})]),
        ToolResult("12"),
        Assistant(reasoning="now add", tool_calls=[ToolCall("calc", {"expr": "2+12", "digits": 0})]),
        ToolResult("14"),
        Assistant("14", reasoning="done"),
    ]


# ------------------------------------------------------------------------------------------------ golden strings


def test_single_user_turn_thinking_on_and_off():
    msgs = [System("be brief"), User("hi")]
    assert chat.encode(msgs) == B + "be brief" + U + "hi" + A + "<think>"
    assert chat.encode(msgs, thinking=False) == B + "be brief" + U + "hi" + A + "</think>"
    assert chat.encode([User("hi")], add_generation_prompt=False) == B + U + "hi"


def test_dict_messages_match_dataclasses():
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "ok", "reasoning_content": "r",
             "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
            {"role": "tool", "content": "x"}]
    assert chat.encode(msgs) == chat.encode([User("hi"), Assistant("ok", "r", [ToolCall("f", {"a": 1})]),
                                             ToolResult("x")])


def test_tool_episode_keeps_all_reasoning():
    expected = (B + U + "what is 2+3*4?" + A + "<think>" + "use calc</think>" + CALL1 + E + RES12 + "<think>"
                + "now add</think>" + CALL2 + E + RES14 + "<think>" + "done</think>14" + E)
    assert chat.encode(episode()) == expected
    # the open episode (ends with a tool result): the generation prompt continues the thinking
    assert chat.encode(episode()[:3]) == B + U + "what is 2+3*4?" + A + "<think>use calc</think>" + CALL1 + E + \
        RES12 + "<think>"


def test_new_user_message_drops_earlier_reasoning_keeps_calls_and_results():
    expected = (B + U + "what is 2+3*4?" + A + "</think>" + CALL1 + E + RES12 + "</think>" + CALL2 + E + RES14
                + "</think>" + "14" + E + U + "thanks" + A + "<think>")
    assert chat.encode(episode() + [User("thanks")]) == expected
    # "never" keeps everything; the new turn still opens with <think>
    kept = (B + U + "what is 2+3*4?" + A + "<think>use calc</think>" + CALL1 + E + RES12 + "<think>now add</think>"
            + CALL2 + E + RES14 + "<think>done</think>14" + E + U + "thanks" + A + "<think>")
    assert chat.encode(episode() + [User("thanks")], drop_thinking="never") == kept


def test_every_turn_drops_all_but_the_last_turn():
    expected = (B + U + "what is 2+3*4?" + A + "</think>" + CALL1 + E + RES12 + "</think>" + CALL2 + E + RES14
                + "<think>done</think>14" + E)
    assert chat.encode(episode(), drop_thinking="every_turn") == expected
    # with a generation prompt after a tool result, the turn to generate is the one that thinks
    assert chat.encode(episode()[:3], drop_thinking="every_turn") == (B + U + "what is 2+3*4?" + A + "</think>"
                                                                      + CALL1 + E + RES12 + "<think>")


def test_thinking_off_renders_no_reasoning():
    expected = (B + U + "what is 2+3*4?" + A + "</think>" + CALL1 + E + RES12 + "</think>" + CALL2 + E + RES14
                + "</think>14" + E)
    assert chat.encode(episode(), thinking=False) == expected


def test_several_calls_in_one_turn_share_one_results_block():
    msgs = [User("go"), Assistant("two", "r", [ToolCall("a", {}), ToolCall("b", {"s": "x y", "l": [1, True]})]),
            ToolResult("ra"), ToolResult("rb")]
    expected = (B + U + "go" + A + "<think>r</think>two\n\n<｜DSML｜function_calls>\n"
                + '<｜DSML｜invoke name="a">\n\n</｜DSML｜invoke>\n'
                + '<｜DSML｜invoke name="b">\n<｜DSML｜parameter name="s" string="true">x y</｜DSML｜parameter>\n'
                + '<｜DSML｜parameter name="l" string="false">[1, true]</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
                + "</｜DSML｜function_calls>" + E
                + "\n\n<function_results>\n<result>ra</result>\n<result>rb</result>\n</function_results>\n\n<think>")
    assert chat.encode(msgs) == expected


def test_tools_are_rendered_into_the_system_prompt():
    tool = Tool("calc", "evaluate", {"type": "object", "properties": {"expr": {"type": "string"}}})
    text = chat.encode([System("sys"), User("hi")], tools=[tool])
    schema = '{"name": "calc", "description": "evaluate", "parameters": {"type": "object", "properties": {"expr": ' \
             '{"type": "string"}}}}'
    assert text.startswith(B + "sys\n\n## Tools\n\nYou have access to a set of tools you can use to answer the "
                           "user's question.\nYou can invoke functions by writing a \"<｜DSML｜function_calls>\" block")
    assert text.endswith("Here are the functions available in JSONSchema format:\n<functions>\n" + schema
                         + "\n</functions>\n" + U + "hi" + A + "<think>")
    assert '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>' in text
    # no system message: an empty one carries the tools; OpenAI-style tool dicts work the same
    openai = {"type": "function", "function": {"name": "calc", "description": "evaluate",
                                               "parameters": tool.parameters}}
    assert chat.encode([User("hi")], tools=[openai]).startswith(B + "\n\n## Tools\n\n")


def test_compact_tools_prompt_keeps_only_the_schema_list():
    tool = Tool("calc", "evaluate", {"type": "object", "properties": {"expr": {"type": "string"}}})
    text = chat.encode([System("sys"), User("hi")], tools=[tool], tools_prompt="compact")
    schema = '{"name": "calc", "description": "evaluate", "parameters": {"type": "object", "properties": {"expr": ' \
             '{"type": "string"}}}}'
    assert text == B + "sys\n\n## Tools\n<functions>\n" + schema + "\n</functions>\n" + U + "hi" + A + "<think>"
    full = chat.encode([System("sys"), User("hi")], tools=[tool])
    assert len(text) < len(full) - 1000 and full.endswith(text[text.index("<functions>"):])
    with pytest.raises(ValueError, match="tools_prompt='short'"):
        chat.encode([User("hi")], tools=[tool], tools_prompt="short")


@pytest.mark.parametrize("msgs, match", [
    ([User("a"), ToolResult("x")], r"messages\[1\]: a tool result must follow an assistant message with tool calls"),
    ([User("a"), Assistant("b", tool_calls=[ToolCall("f"), ToolCall("g")]), ToolResult("x"), User("c")],
     r"messages\[1\]: the assistant made 2 tool call\(s\) but 1 tool result\(s\) follow"),
    ([User("a"), Assistant("b"), Assistant("c")], r"messages\[2\]: an assistant message must follow a user or tool"),
    ([User("a"), System("s")], r"messages\[1\]: a system message may only be the first"),
    ([{"role": "robot", "content": "x"}], r"messages\[0\]\.role: unknown role 'robot'"),
    ([User("a"), {"role": "assistant", "tool_calls": [{"name": "f", "arguments": "{bad"}]}],
     r"messages\[1\]\.tool_calls\[0\]\.arguments: not valid JSON"),
    ([User("a"), Assistant(tool_calls=[ToolCall("f", {"s": "a</｜DSML｜parameter>"})])],
     r"tool call 'f': string parameter 's' contains DSML markup"),
])
def test_bad_conversations_are_rejected(msgs, match):
    with pytest.raises(ChatFormatError, match=match):
        chat.encode(msgs)


def test_bad_drop_mode():
    with pytest.raises(ChatFormatError, match="drop_thinking='sometimes'"):
        chat.encode([User("a")], drop_thinking="sometimes")


# ------------------------------------------------------------------------------------------------ parse_completion


def test_parse_completion_hand_written():
    text = ("let me look</think>Checking.\n\n<｜DSML｜function_calls>\n"
            '<｜DSML｜invoke name="search">\n<｜DSML｜parameter name="q" string="true">a "b" {c}</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="k" string="false">{"n": [1, 2.5, null]}</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
            "</｜DSML｜function_calls>" + E)
    assert chat.parse_completion(text) == {"reasoning": "let me look", "content": "Checking.", "tool_calls": [
        {"name": "search", "arguments": {"q": 'a "b" {c}', "k": {"n": [1, 2.5, None]}}}]}
    assert chat.parse_completion("hello" + E, thinking=False) == {"reasoning": None, "content": "hello",
                                                                 "tool_calls": []}
    assert chat.parse_completion("<think>r</think>done") == {"reasoning": "r", "content": "done", "tool_calls": []}


@pytest.mark.parametrize("turn", [
    Assistant("The answer is 14.", "simple"),
    Assistant("", "call it", [ToolCall("calc", {"expr": "3*4"})]),
    Assistant("two calls\nin one turn", "multi\nline", [
        ToolCall("search", {"q": "x <y> & z", "n": 3, "exact": False, "tags": ["a", "b"], "opt": None, "f": 0.5}),
        ToolCall("noargs", {}),
        ToolCall("calc", {"expr": "", "nested": {"a": [1, {"b": "c"}]}}),
    ]),
])
@pytest.mark.parametrize("thinking", [True, False])
def test_parse_completion_round_trips_an_encoded_turn(turn, thinking):
    prompt = chat.encode([User("q")], thinking=thinking)
    full = chat.encode([User("q"), turn], thinking=thinking)
    assert full.startswith(prompt)
    parsed = chat.parse_completion(full[len(prompt):], thinking=thinking)
    want_calls = [{"name": c.name, "arguments": c.arguments} for c in turn.tool_calls]
    assert parsed == {"reasoning": turn.reasoning if thinking else None, "content": turn.content,
                      "tool_calls": want_calls}
    # types survive: string="false" values are JSON, string="true" values stay strings
    for got, want in zip(parsed["tool_calls"], want_calls):
        assert json.dumps(got["arguments"]) == json.dumps(want["arguments"])


P = '<｜DSML｜parameter name="{}" string="{}">{}</｜DSML｜parameter>'
OPEN, CLOSE = "\n\n<｜DSML｜function_calls>\n", "\n</｜DSML｜function_calls>"


@pytest.mark.parametrize("text, match", [
    ("no close tag", r"missing '</think>'"),
    ("r</think>" + OPEN + '<｜DSML｜invoke name="calc">\n' + P.format("expr", "true", "1") + CLOSE,
     r"unclosed invoke 'calc' at offset 34: no '</｜DSML｜invoke>' before offset 124"),
    ("r</think>" + OPEN + P.format("a", "true", "1") + CLOSE, r"parameter outside invoke at offset 34"),
    ("r</think>x" + P.format("a", "true", "1"), r"parameter outside invoke: .* in content at offset 10"),
    ("r</think>" + OPEN + '<｜DSML｜invoke name="calc">\n' + P.format("x", "false", "{oops") + "\n</｜DSML｜invoke>"
     + CLOSE, r"bad JSON in parameter 'x' of tool 'calc' at offset"),
    ("r</think>" + OPEN + '<｜DSML｜invoke name="rm_rf">\n\n</｜DSML｜invoke>' + CLOSE,
     r"unknown tool 'rm_rf' in invoke at offset 34 \(tools: calc\)"),
    ("r</think>" + OPEN + '<｜DSML｜invoke name="calc">\n' + P.format("expr", "true", "1") + "\n"
     + P.format("expr", "true", "2") + "\n</｜DSML｜invoke>" + CLOSE, r"duplicate parameter 'expr' of tool 'calc'"),
    ("r</think>" + OPEN + '<｜DSML｜invoke name="calc">\n' + P.format("zz", "true", "1") + "\n</｜DSML｜invoke>"
     + CLOSE, r"unknown parameter 'zz' of tool 'calc'"),
    ("r</think>" + OPEN + '<｜DSML｜invoke name="calc">\n\n</｜DSML｜invoke>' + CLOSE,
     r"missing required parameter 'expr' of tool 'calc'"),
    ("r</think>" + OPEN + '<｜DSML｜invoke name="calc">\n<｜DSML｜parameter name="expr">1</｜DSML｜parameter>',
     r"malformed parameter tag in invoke 'calc' at offset 61"),
    ("r</think>" + OPEN + '<｜DSML｜invoke nam="calc">', r"malformed invoke tag at offset 34"),
    ("r</think>" + OPEN + '<｜DSML｜invoke name="calc">\n<｜DSML｜parameter name="expr" string="true">1\n'
     '</｜DSML｜invoke>' + CLOSE, r"unclosed parameter 'expr' of tool 'calc' at offset 61"),
    ("r</think>" + OPEN + '<｜DSML｜invoke name="calc">\n' + P.format("expr", "true", "1") + "\n</｜DSML｜invoke>",
     r"unclosed function_calls block at offset 11"),
    ("r</think>" + OPEN + "hello" + CLOSE, r"unexpected text 'hello.*' in function_calls block at offset 34"),
    ("r</think>ok" + E + "more", r"text after '<｜end▁of▁sentence｜>' at offset 30"),
    ("r</think>ok" + OPEN + '<｜DSML｜invoke name="calc">\n' + P.format("expr", "true", "1") + "\n</｜DSML｜invoke>"
     + CLOSE + "trailing", r"unexpected text after '</｜DSML｜function_calls>'"),
    ("r</think>ok<｜User｜>hi", r"unexpected special token '<｜User｜>' in content at offset 11"),
    ("r<think>s</think>ok", r"unexpected special token '<think>' in reasoning at offset 1"),
    ("r</think><function_results>", r"model-generated '<function_results>' in content"),
    ("r</think>see <result> 41", r"model-generated '<result>' in content at offset 13"),
    ("r</think>41</result>", r"unexpected special token '</result>' in content at offset 11"),
    ("r</think>" + OPEN + '<｜DSML｜invoke name="calc">\n' + P.format("expr", "true", "1</result>")
     + "\n</｜DSML｜invoke>" + CLOSE, r"unexpected special token '</result>' in parameter 'expr' of tool 'calc'"),
    # json's int limit (over 4300 digits) and deep nesting raise ValueError / RecursionError, not JSONDecodeError
    ("r</think>" + OPEN + '<｜DSML｜invoke name="calc">\n' + P.format("expr", "true", "1") + "\n"
     + P.format("x", "false", "9" * 4400) + "\n</｜DSML｜invoke>" + CLOSE,
     r"bad JSON in parameter 'x' of tool 'calc' at offset \d+: Exceeds the limit"),
    ("r</think>" + OPEN + '<｜DSML｜invoke name="calc">\n' + P.format("expr", "true", "1") + "\n"
     + P.format("x", "false", "[" * 100_000) + "\n</｜DSML｜invoke>" + CLOSE,
     r"bad JSON in parameter 'x' of tool 'calc' at offset \d+: "),
    ("think" + OPEN + "</think>ok", r"tool calls in reasoning at offset 7 \(calls go after '</think>'\)"),
    ("r</think>ok" + CLOSE, r"'</｜DSML｜function_calls>' without '<｜DSML｜function_calls>' in content at offset 12"),
])
def test_malformed_completions_raise(text, match):
    tools = [Tool("calc", "", {"type": "object", "properties": {"expr": {"type": "string"}, "x": {}},
                               "required": ["expr"]})]
    with pytest.raises(ChatFormatError, match=match):
        chat.parse_completion(text, tools=tools)
    assert issubclass(ChatFormatError, ValueError)


# ------------------------------------------------------------------------------------------------ codecs and masks


def masked_runs(codec, ids, mask) -> list[str]:
    """The decoded contiguous runs of mask == 1."""
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(codec.decode(cur))
            cur = []
    if cur:
        runs.append(codec.decode(cur))
    return runs


@pytest.fixture(scope="module", params=["tiny", "tiny-printable", "bpe"])
def codec(request):
    if request.param == "tiny":
        return chat.TinyCodec()
    if request.param == "tiny-printable":
        return chat.TinyCodec.printable()
    return chat.load_tokenizer()


def test_codec_round_trip_and_single_id_specials(codec):
    text = chat.encode(episode() + [User("thanks")])
    ids = codec.encode(text)
    assert codec.decode(ids) == text
    assert max(ids) < codec.vocab_size
    for tok in chat.SPECIAL_TOKENS:
        assert codec.encode(tok) == [codec.token_to_id(tok)]
    assert len({codec.token_to_id(t) for t in chat.SPECIAL_TOKENS}) == len(chat.SPECIAL_TOKENS)
    assert codec.eos_id == codec.token_to_id(E) and codec.bos_id == codec.token_to_id(B)
    assert codec.encode(B + U + "hi" + A)[:2] == [codec.bos_id, codec.token_to_id(U)]


def test_loss_mask_covers_exactly_the_assistant_tokens(codec):
    ids, mask = chat.encode_tokens(episode(), codec)
    assert ids == codec.encode(chat.encode(episode()))
    assert masked_runs(codec, ids, mask) == ["use calc</think>" + CALL1 + E, "now add</think>" + CALL2 + E,
                                             "done</think>14" + E]
    # after a new user message the old episode is history: nothing of it is trained
    ids, mask = chat.encode_tokens(episode() + [User("thanks"), Assistant("bye", "fine")], codec)
    assert masked_runs(codec, ids, mask) == ["fine</think>bye" + E]
    # every_turn: only the last turn; thinking off: every turn, without reasoning; train=False masks a turn out
    ids, mask = chat.encode_tokens(episode(), codec, drop_thinking="every_turn")
    assert masked_runs(codec, ids, mask) == ["done</think>14" + E]
    ids, mask = chat.encode_tokens(episode(), codec, thinking=False)
    assert masked_runs(codec, ids, mask) == [CALL1 + E, CALL2 + E, "14" + E]
    msgs = episode()
    msgs[3] = Assistant(msgs[3].content, msgs[3].reasoning, msgs[3].tool_calls, train=False)
    ids, mask = chat.encode_tokens(msgs, codec)
    assert masked_runs(codec, ids, mask) == ["use calc</think>" + CALL1 + E, "done</think>14" + E]


def test_prefixes_encode_to_token_prefixes(codec):
    full = episode()
    ids, mask = chat.encode_tokens(full, codec)
    for k in range(1, len(full) + 1):  # every prefix, with the generation prompt where the prefix ends open
        pids, pmask = chat.encode_tokens(full[:k], codec)
        assert ids[:len(pids)] == pids and mask[:len(pmask)] == pmask, k
    # the generation prompt of the last user turn is a prefix of the finished conversation, too
    longer = full + [User("thanks"), Assistant("bye", "fine")]
    lids, _ = chat.encode_tokens(longer, codec)
    pids, _ = chat.encode_tokens(longer[:-1], codec)
    assert lids[:len(pids)] == pids
    assert codec.decode(lids[len(pids):]) == "fine</think>bye" + E


def test_tiny_codec_errors_and_size():
    tiny = chat.TinyCodec()
    assert tiny.vocab_size <= 128 and chat.TinyCodec.printable().vocab_size <= 128
    assert tiny.token_to_id(chat.PAD) == tiny.pad_id == 0
    with pytest.raises(ValueError, match=r"character 'H' \(U\+0048\) at offset 0 is not in the vocabulary"):
        tiny.encode("Hi")
    with pytest.raises(ValueError, match="appears twice"):
        chat.TinyCodec("aa")
    with pytest.raises(ValueError, match="max_vocab"):
        chat.TinyCodec(chat.PRINTABLE_CHARS, max_vocab=64)
    assert chat.TinyCodec("ab").encode("ab</think>") == [17, 18, chat.SPECIAL_TOKENS.index("</think>")]


def test_shipped_tokenizer_dsml_conversation():
    tok = chat.load_tokenizer()
    assert 1000 <= tok.vocab_size <= 2000
    assert tok.pad_id == 0 and tok.bos_id == 1 and tok.eos_id == 2
    props = {"city": {"type": "string"}, "days": {"type": "integer"}}
    tools = [Tool("get_weather", "Weather for a city.", {"type": "object", "properties": props})]
    msgs = [System("You are helpful."), User("Weather in Paris?"),
            Assistant(reasoning="Call the tool.", tool_calls=[ToolCall("get_weather", {"city": "Paris", "days": 3})]),
            ToolResult('{"temp": 21, "sky": "clear"}'), Assistant("21 degrees and clear.", "Got it.")]
    text = chat.encode(msgs, tools=tools)
    ids, mask = chat.encode_tokens(msgs, tok, tools=tools)
    assert tok.decode(ids) == text and ids == tok.encode(text)
    assert len(ids) < len(text) / 2  # BPE merges: much shorter than characters
    for marker in ("<｜DSML｜function_calls>", "<｜DSML｜invoke", "<｜DSML｜parameter", "</｜DSML｜parameter>",
                   "</｜DSML｜invoke>", "</｜DSML｜function_calls>", "<function_results>", "<think>", "</think>"):
        assert ids.count(tok.token_to_id(marker)) == text.count(marker) > 0, marker
    assert masked_runs(tok, ids, mask) == [
        "Call the tool.</think>" + calls_block(invoke("get_weather", ("city", "true", "Paris"), ("days", "false", "3")))
        + E, "Got it.</think>21 degrees and clear." + E]
    # the model's side parses back
    prompt = chat.encode(msgs[:4], tools=tools)
    assert chat.parse_completion(text[len(prompt):], tools=tools)["tool_calls"] == []
    assert chat.parse_completion(tok.decode(ids[len(tok.encode(chat.encode(msgs[:2], tools=tools))):
                                                len(tok.encode(chat.encode(msgs[:3], tools=tools)))]),
                                 tools=tools)["tool_calls"] == [{"name": "get_weather",
                                                                 "arguments": {"city": "Paris", "days": 3}}]


def test_hf_codec_rejects_a_tokenizer_without_the_specials():
    from tokenizers import Tokenizer, models

    with pytest.raises(ValueError, match=r"special token '<｜▁pad▁｜>' is not a single added token"):
        chat.HFCodec(Tokenizer(models.BPE()))


# ------------------------------------------------------------------------------- data is plain text (issue #32)

def _data_conversations(text: str):
    """(kind, messages, tools) with `text` as data in every message kind the encoding renders."""
    tool = Tool("calc", f"d{text}", {"type": "object", "properties": {"expr": {"type": "string", "description": text}}})
    call = ToolCall("calc", {"expr": "1"})
    yield "system", [System(f"s{text}e"), User("hi")], None
    yield "user", [User(f"a{text}b")], None
    yield "tool result", [User("q"), Assistant(tool_calls=[call]), ToolResult(f"r{text}r")], None
    yield "assistant history", [User("q"), Assistant(f"c{text}c", reasoning=f"r{text}r"), User("next")], None
    yield "tool schema", [User("q")], [tool]
    yield "json argument", [User("q"), Assistant(tool_calls=[ToolCall("calc", {"n": [text]})]), ToolResult("1")], None
    if chat.DSML not in text:  # DSML in a string argument is refused (below)
        yield "string argument", [User("q"), Assistant(tool_calls=[ToolCall("calc", {"e": f"x{text}"})]),
                                  ToolResult("1")], None


@pytest.fixture(scope="module", params=["tiny", "bpe"])
def plain_codec(request):
    """A TinyCodec that has the markers' characters (so every marker is encodable as text) and the shipped BPE."""
    return chat.TinyCodec(chat.PRINTABLE_CHARS + "｜▁") if request.param == "tiny" else chat.load_tokenizer()


def test_data_never_becomes_special_tokens(plain_codec):
    """Every special token string of the codec, in every message kind: the special ids are exactly those of the same
    conversation with the data replaced by "x" (the markup's), and decoding gives the literal text back.
    Mutation tried: `encode_parts` encoding data with `codec.encode` (specials on) fails every kind."""
    codec = plain_codec
    special_ids = {codec.token_to_id(t) for t in codec.special_tokens}
    assert len(codec.special_tokens) >= len(chat.SPECIAL_TOKENS)
    for marker in codec.special_tokens:
        neutral = {kind: (msgs, tools) for kind, msgs, tools in _data_conversations("x")}
        for kind, msgs, tools in _data_conversations(f"{marker} {marker}"):
            ids, mask = chat.encode_tokens(msgs, codec, tools=tools, drop_thinking="never")
            want, _ = chat.encode_tokens(neutral[kind][0], codec, tools=neutral[kind][1], drop_thinking="never")
            assert [i for i in ids if i in special_ids] == [i for i in want if i in special_ids], (marker, kind)
            assert codec.decode(ids) == chat.encode(msgs, tools=tools, drop_thinking="never"), (marker, kind)
            assert len(mask) == len(ids)


def test_dsml_in_a_string_argument_is_refused():
    with pytest.raises(ChatFormatError, match="string parameter 'e' contains DSML markup"):
        chat.encode([User("q"), Assistant(tool_calls=[ToolCall("calc", {"e": "<｜DSML｜invoke"})])])


def test_tiny_codec_without_the_characters_refuses_instead_of_a_special():
    """The default TinyCodec has no '｜': data spelling '<｜User｜>' cannot be encoded as text and raises naming the
    character; '<think>' (all of whose characters it has) is 7 ids of text."""
    tiny = chat.TinyCodec()
    with pytest.raises(ValueError, match=r"character '｜' \(U\+FF5C\) at offset 1"):
        tiny.encode_text("<｜User｜>")
    assert tiny.encode_text("<think>") == tiny.encode("<") + tiny.encode("think>")
    assert tiny.encode("<think>") == [tiny.token_to_id("<think>")]
    ids, _ = chat.encode_tokens([User("say <think> please")], tiny)
    assert tiny.token_to_id("<think>") not in ids[:-1]  # only the generation prompt's opener
    assert ids[-1] == tiny.token_to_id("<think>")


def test_ordinary_text_keeps_its_ids(codec):
    """Conversations whose data holds no special-token string encode to the ids of their whole string, as before
    data was encoded as text (trained checkpoints rely on them)."""
    msgs = episode() + [User("thanks, <b>bold</b> and <i>"), Assistant("bye", "fine")]
    tools = [Tool("calc", "evaluate <expr>.", {"type": "object", "properties": {"expr": {"type": "string"}}})]
    tools = None if "#" not in getattr(codec, "chars", "#") else tools  # TinyCodec(): no '#' for "## Tools"
    text = chat.encode(msgs, tools=tools)
    assert chat.encode_tokens(msgs, codec, tools=tools)[0] == codec.encode(text)


def test_decode_completion_checks_eos_pad_and_bos():
    """Mutation tried: dropping the after-EOS check lets `ids + [eos, x]` through; dropping the PAD / BOS check lets
    them through as content."""
    tiny = chat.TinyCodec()
    ids = tiny.encode("ok</think>42")
    assert chat.decode_completion(ids + [tiny.eos_id], tiny) == "ok</think>42" + E
    assert chat.decode_completion(ids, tiny) == "ok</think>42"  # no EOS: the caller's "truncated"
    with pytest.raises(ChatFormatError, match=r"text after '<｜end▁of▁sentence｜>' at token offset 6 of 8: '1<"):
        chat.decode_completion(ids + [tiny.eos_id] + tiny.encode("1") + [tiny.eos_id], tiny)
    for bad, name in ((tiny.pad_id, "pad"), (tiny.bos_id, "begin")):
        with pytest.raises(ChatFormatError, match=f"{name}.*at token offset 2 of the completion"):
            chat.decode_completion(ids[:2] + [bad] + ids[2:] + [tiny.eos_id], tiny)


@pytest.mark.parametrize("text, match", [
    ("ok</think>4<｜▁pad▁｜>2", "unexpected special token '<｜▁pad▁｜>' in content"),
    ('r</think>\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="calc">\n<｜DSML｜parameter name="expr" '
     'string="true">1<｜User｜>2</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>',
     r"unexpected special token '<｜User｜>' in parameter 'expr' of tool 'calc' at offset"),
])
def test_special_tokens_in_completion_data_are_format_errors(text, match):
    with pytest.raises(ChatFormatError, match=match):
        chat.parse_completion(text)


# ------------------------------------------------------------------------------- gaps found by mutation testing


@pytest.mark.parametrize("msgs, match", [
    # the conversation ends inside a results block: one result for two calls
    ([User("a"), Assistant(tool_calls=[ToolCall("f"), ToolCall("g")]), ToolResult("x")],
     r"messages\[1\]: the assistant made 2 tool call\(s\) but only 1 tool result\(s\) follow it"),
    # more results than calls: the second result answers nothing
    ([User("a"), Assistant(tool_calls=[ToolCall("f")]), ToolResult("x"), ToolResult("y")],
     r"messages\[3\]: a tool result must follow an assistant message with tool calls \(one result per call\)"),
])
def test_results_must_match_the_calls_one_to_one(msgs, match):
    """The format pairs results with calls in order (package docstring: "one per call"). Mutants guarded: dropping
    the end-of-conversation check (a conversation ending with 1 result for 2 calls rendered, the generation prompt
    after it), and counting only that some assistant made calls (`if not pending`: a surplus result accepted)."""
    with pytest.raises(ChatFormatError, match=match):
        chat.encode(msgs)


def test_tool_schemas_are_one_json_object_per_line_without_ascii_escapes():
    """Package docstring: one JSON object per tool inside <functions>, `json.dumps` with `ensure_ascii=False`; JSON
    argument values likewise. Golden string written by hand. Mutants guarded: schemas joined without the newline
    (`{...}{...}`), and `ensure_ascii=True` (\\u00e9 escapes the published encoder never writes)."""
    tools = [Tool("a", "température", {"type": "object"}), Tool("b", "", {})]
    text = chat.encode([User("hi")], tools=tools, tools_prompt="compact")
    assert text == (B + "\n\n## Tools\n<functions>\n"
                    + '{"name": "a", "description": "température", "parameters": {"type": "object"}}\n'
                    + '{"name": "b", "description": "", "parameters": {}}\n</functions>\n' + U + "hi" + A + "<think>")
    turn = chat.render_tool_calls([ToolCall("f", {"tags": ["café"], "s": "café"})])
    assert turn == calls_block(invoke("f", ("tags", "false", '["café"]'), ("s", "true", "café")))


def test_dict_messages_train_like_dataclasses():
    """OpenAI-style dict messages: an assistant dict is trained unless it says "train": false (as the dataclass's
    default `train=True`), and a call whose arguments are the empty string has no arguments. Mutants guarded:
    `value.get("train", False)` (SFT on dict conversations trains nothing), and `json.loads("")` raising."""
    codec = chat.TinyCodec()
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "ok", "reasoning": "r",
             "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": ""}}]},
            {"role": "tool", "content": "1"},
            {"role": "assistant", "content": "done", "reasoning": "s", "train": False}]
    ids, mask = chat.encode_tokens(msgs, codec)
    empty_call = calls_block('<｜DSML｜invoke name="f">\n\n</｜DSML｜invoke>')
    assert masked_runs(codec, ids, mask) == ["r</think>ok" + empty_call + E]  # the train=False turn is not trained
    assert codec.decode(ids).endswith("<think>s</think>done" + E)


def test_parse_completion_tool_table_edge_cases():
    """`tools=` checks: a schema with "additionalProperties": true accepts parameters it does not list (JSON
    schema's meaning), and an empty tool list means no call is valid. Mutants guarded: ignoring
    additionalProperties (every extra parameter an error), and `if tools and ...` (tools=[] accepting any call)."""
    text = ("r</think>" + OPEN + '<｜DSML｜invoke name="calc">\n' + P.format("expr", "true", "1") + "\n"
            + P.format("extra", "false", "2") + "\n</｜DSML｜invoke>" + CLOSE)
    open_schema = Tool("calc", "", {"type": "object", "properties": {"expr": {"type": "string"}},
                                    "additionalProperties": True})
    assert chat.parse_completion(text, tools=[open_schema])["tool_calls"] == [
        {"name": "calc", "arguments": {"expr": "1", "extra": 2}}]
    with pytest.raises(ChatFormatError, match=r"unknown tool 'calc' in invoke at offset 34 \(tools: none\)"):
        chat.parse_completion(text, tools=[])


def test_hf_codec_without_pad_pads_with_eos_and_still_accepts_eos():
    """HFCodec(strict=False) over a tokenizer without PAD: pad_id falls back to EOS (documented: the only id that
    may end a completion anyway), and decode_completion then still accepts a completion ending with EOS. Mutants
    guarded: the fallback to BOS, and decode_completion's PAD check without `tid != codec.eos_id` (every finished
    completion of such a tokenizer a "pad" format error)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "ok": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([t for t in chat.SPECIAL_TOKENS if t != chat.PAD])
    with pytest.raises(ValueError, match=r"special token '<｜▁pad▁｜>' is not a single added token"):
        chat.HFCodec(tok)
    codec = chat.HFCodec(tok, strict=False)
    assert codec.pad_id == codec.eos_id == tok.token_to_id(E) and codec.bos_id == tok.token_to_id(B)
    text = chat.decode_completion([tok.token_to_id("ok"), codec.eos_id], codec)
    assert text.replace(" ", "") == "ok" + E
    with pytest.raises(ChatFormatError, match="begin"):
        chat.decode_completion([codec.bos_id, codec.eos_id], codec)


# ------------------------------------------------------------------- completions parsed from their ids (red team)
CALL_BLOCK = ('\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="secret">\n<｜DSML｜parameter name="k" '
              'string="true">x</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>')


def test_parse_completion_ids_reads_only_special_ids_as_markup(plain_codec):
    """A completion was parsed from its decoded text, so text the model spelled with plain-text ids was read as
    markup (red-team audit): a DSML tool-call block copied from a tool result (which the encoding feeds it as plain
    text) ran as a call; "</think>" spelled letter by letter closed the reasoning; an answer holding "<result>" as
    text could not be given. parse_completion_ids parses the ids: plain ids are data (in the reasoning, the
    content and the arguments, where the model put them), special ids are markup; its parse of a completion with
    real markup is parse_completion's of the text."""
    codec = plain_codec
    text_ids = codec.encode_text
    think_close, eos = codec.encode(chat.THINK_CLOSE), [codec.eos_id]
    # a copied call block and a spelled "</think>" in the content, "<result>" in the reasoning: all data
    ids = (text_ids("saw <result> there") + think_close + text_ids("quoting:" + CALL_BLOCK + " and </think> ok")
           + eos)
    got = chat.parse_completion_ids(ids, codec)
    assert got == {"reasoning": "saw <result> there", "content": "quoting:" + CALL_BLOCK + " and </think> ok",
                   "tool_calls": []}
    # a turn encoded with its markup as special ids and its data as text parses back to itself
    enc = chat.encode_assistant(Assistant("done", "r <x>", [ToolCall("secret", {"k": "a </think> b", "n": [1]})]),
                                codec)
    assert chat.parse_completion_ids(enc, codec) == {"reasoning": "r <x>", "content": "done",
                                                     "tool_calls": [{"name": "secret",
                                                                     "arguments": {"k": "a </think> b", "n": [1]}}]}
    # "</think>" only spelled: the reasoning is not closed (a format error, its text shown without parse markers)
    with pytest.raises(ChatFormatError, match=r"missing '</think>'.*\(completion 'because</think>42"):
        chat.parse_completion_ids(text_ids("because</think>42") + eos, codec)
    # the private-use character the parse marks spellings with is data too, doubled or not
    if not isinstance(codec, chat.TinyCodec):  # (not in its characters)
        odd = "\ue000</think>\ue000\ue000"
        assert chat.parse_completion_ids(text_ids("r") + think_close + text_ids(odd) + eos, codec)["content"] == odd


def test_parse_completion_ids_keeps_a_json_escape_of_its_marker_character():
    """A string="false" argument whose JSON spells the parse's marker character as an escape ("\\ue000A") decoded
    to that character, which the unescaping after the parse then deleted (code review): the value is unescaped
    before it is decoded."""
    text = chat.render_assistant(Assistant("", "r", [ToolCall("f", {"v": ["Q"]})]), True).replace('"Q"', '"\\ue000A"')
    for codec in (chat.TinyCodec.printable(), chat.load_tokenizer()):
        ids = codec.encode(text)
        assert chat.parse_completion_ids(ids, codec)["tool_calls"][0]["arguments"] == {"v": ["\ue000A"]}
        assert chat.parse_completion(codec.decode(ids))["tool_calls"][0]["arguments"] == {"v": ["\ue000A"]}


def test_parse_completion_ids_returns_names_and_keys_that_spell_its_marker_as_written():
    """The parse marks special-token spellings with a private-use character (doubling it where the text has it):
    every string it extracts is unescaped once, the tool's name and the parameter keys too, so a name or key
    holding that character comes back as the model wrote it, as parse_completion reads the decoded text. Mutants
    guarded: the invoke name, or a parameter key, not unescaped ("f\ue000\ue000")."""
    codec = chat.load_tokenizer()
    turn = Assistant("", "r", [ToolCall("f\ue000", {"k\ue000": "v\ue000", "n\ue000": ["\ue000"]})])
    ids = chat.encode_assistant(turn, codec)
    want = {"reasoning": "r", "content": "",
            "tool_calls": [{"name": "f\ue000", "arguments": {"k\ue000": "v\ue000", "n\ue000": ["\ue000"]}}]}
    assert chat.parse_completion_ids(ids, codec) == want == chat.parse_completion(codec.decode(ids))


class _SomeDsmlTags:
    """The shipped BPE codec as a (non-strict) tokenizer that has only the function_calls tags as single ids: the
    invoke and parameter tags are spelled in plain ids (`token_to_id` raises for them, as HFCodec's does)."""

    def __init__(self):
        self._c = chat.load_tokenizer()
        self.eos_id, self.bos_id, self.pad_id, self.vocab_size = (self._c.eos_id, self._c.bos_id, self._c.pad_id,
                                                                  self._c.vocab_size)

    def token_to_id(self, tok):
        if chat.DSML in tok and tok not in (chat.CALLS_OPEN, chat.CALLS_CLOSE):
            raise ValueError(f"{tok!r} is not a single token")
        return self._c.token_to_id(tok)

    def decode(self, ids):
        return self._c.decode(ids)

    def encode_text(self, text):
        return self._c.encode_text(text)


def test_parse_completion_ids_reads_dsml_from_the_text_unless_the_codec_has_every_tag_as_an_id():
    """A codec without every DSML tag as one id spells the others in plain ids, so its completions' DSML is read
    from the text (the docstring: DSML tags count as markup only where the codec has them as single ids); a call
    whose function_calls tags are single ids and whose invoke / parameter tags are plain text is a call. Mutant
    guarded: `any` tag as an id taken for all of them (the plain invoke tag escaped: "unexpected text in
    function_calls block", the model of such a tokenizer could make no call)."""
    codec = _SomeDsmlTags()
    block = CALL_BLOCK[len("\n\n<｜DSML｜function_calls>"):-len("</｜DSML｜function_calls>")]
    ids = (codec.encode_text("r") + [codec.token_to_id(chat.THINK_CLOSE)] + codec.encode_text("ok\n\n")
           + [codec.token_to_id(chat.CALLS_OPEN)] + codec.encode_text(block) + [codec.token_to_id(chat.CALLS_CLOSE)]
           + [codec.eos_id])
    assert chat.parse_completion_ids(ids, codec) == {"reasoning": "r", "content": "ok", "tool_calls": [
        {"name": "secret", "arguments": {"k": "x"}}]}


def test_parse_completion_ids_keeps_the_id_level_checks():
    tiny = chat.TinyCodec()
    ids = tiny.encode("r</think>a") + [tiny.eos_id]
    with pytest.raises(ChatFormatError, match="text after"):
        chat.parse_completion_ids(ids + tiny.encode("b"), tiny)
    with pytest.raises(ChatFormatError, match="at token offset 1 of the completion"):
        chat.parse_completion_ids(ids[:1] + [tiny.pad_id] + ids[1:], tiny)


def test_parse_completion_ids_equals_parse_completion_on_ordinary_completions(codec):
    """Without special-token spellings in the data, parsing the ids is parsing the decoded text."""
    for turn in (Assistant("4", "2 + 2"), Assistant("", "look", [ToolCall("calc", {"expr": "1+2", "n": 3})]),
                 Assistant("a\n\nb", "", [ToolCall("f", {}), ToolCall("g", {"x": [1, {"y": "z"}]})])):
        ids = chat.encode_assistant(turn, codec)
        assert chat.parse_completion_ids(ids, codec) == chat.parse_completion(codec.decode(ids))
