"""The DeepSeek-V3.2 chat encoding: prompts, DSML tool calls, thinking retention, loss masks, two codecs.

Modules: ``tokens`` (the special tokens, :class:`ChatFormatError`), ``messages`` (message and tool dataclasses),
``encoding`` (conversations -> prompt string / ids + loss mask), ``parsing`` (completions -> reasoning, content, tool
calls), ``codecs`` (:class:`TinyCodec`, :class:`HFCodec`). Every name is importable from ``dsv32_jax.posttrain.chat``.

Written from DeepSeek's description of V3.2's chat format (``encoding/encoding_dsv32.py`` in the HF repositories
deepseek-ai/DeepSeek-V3.2 and -Exp; read, not copied) and from section 3.2.1 of the V3.2 report ("Thinking Context
Management"). Pure Python: no jax, no numpy; ``tokenizers`` is imported only by :class:`HFCodec`.

The format, piece by piece (``BOS``/``EOS`` = ``<｜begin▁of▁sentence｜>``/``<｜end▁of▁sentence｜>``)::

    BOS {system}[\\n\\n{tools prompt}]                     system message (optional, first only)
    <｜User｜>{user}<｜Assistant｜>{opener}                  user message + the assistant prefix
    {reasoning}</think>{content}[{calls}]EOS               assistant turn whose reasoning is kept
    {content}[{calls}]EOS                                  assistant turn whose reasoning is dropped
    \\n\\n<function_results>\\n<result>{r1}</result>\\n...\\n</function_results>\\n\\n{opener}   the results of one turn

``{opener}`` is ``<think>`` when the next assistant turn keeps its reasoning and ``</think>`` otherwise (so a
dropped turn reads ``...</think>{content}EOS``; with ``thinking=False`` every opener is ``</think>``). Note there is
no ``<｜Assistant｜>`` after tool results: the assistant continues right after the results block. Tool calls::

    \\n\\n<｜DSML｜function_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

``string="true"``: the value is the raw string; ``string="false"``: the value is JSON (numbers, booleans, null,
lists, objects). Parameters are joined by ``\\n``, invokes by ``\\n``; an invoke without arguments has an empty line.
The tools prompt is :data:`TOOLS_PROMPT` with one JSON object per tool (``{"name", "description", "parameters"}``,
``json.dumps`` with ``ensure_ascii=False``) inside ``<functions>...</functions>``.

Thinking retention (``drop_thinking``):

* ``"after_user"`` (V3.2, the default): reasoning of assistant turns BEFORE the last user message is dropped (their
  content, tool calls and the tool results stay); turns after it -- the current tool-calling episode -- keep it.
* ``"every_turn"`` (R1-style ablation): only the last assistant turn (or the turn to be generated) keeps reasoning.
* ``"never"``: every assistant turn keeps its reasoning.

Assumptions and departures from the published encoder (documented here because they change strings):

* ``tools=`` is rendered into the system message (the published encoder reads ``tools`` off the system message);
  without a system message, an empty one is made, so the prompt starts ``BOS \\n\\n## Tools``.
* ``drop_thinking="never"`` really keeps old reasoning (opener ``<think>`` before every assistant turn); the
  published V3.2 encoder renders history the same way with or without its ``drop_thinking`` flag.
* ``add_generation_prompt=False`` leaves out the trailing ``<｜Assistant｜>{opener}`` (or ``\\n\\n{opener}`` after tool
  results); the published encoder always writes it.
* Structure is validated (system first only; an assistant turn follows a user message or tool results; tool results
  follow an assistant turn with calls, one per call, in order; a turn with calls is followed by its results or ends
  the conversation): violations raise :class:`ChatFormatError` naming the message.
* Data is plain text: system prompts, user messages, tool results, tool schemas and the assistant's reasoning,
  content and arguments never become special tokens (``codec.encode_text``), whatever they spell; only the format's
  markup does (``encoding`` module docstring).
* The codecs in this package treat 17 strings as single tokens (:data:`SPECIAL_TOKENS`): pad, BOS, EOS, the role
  markers, the think tags, the six DSML tags (``<｜DSML｜invoke`` / ``<｜DSML｜parameter`` without their attributes)
  and the function_results / result tags. DeepSeek's own tokenizer splits some of these; that changes ids, not text.

Loss mask (:func:`encode_tokens`): 1 exactly on what the model generated in trained turns -- ``{reasoning}</think>``
(when kept), content, tool-call markup and EOS; 0 on BOS, system, user, tool results, the openers and on assistant
turns whose reasoning was dropped (in thinking mode those turns are history, not targets). ``Assistant(train=False)``
masks a turn out explicitly.
"""

from __future__ import annotations

from dsv32_jax.posttrain.chat.codecs import (CHAT_TOKENIZER_PATH, PRINTABLE_CHARS, TINY_CHARS, Codec, HFCodec, TinyCodec,
                                   load_tokenizer)
from dsv32_jax.posttrain.chat.encoding import (COMPACT_TOOLS_PROMPT, TOOLS_PROMPT, Piece, check_encodable, encode,
                                     encode_assistant, encode_parts, encode_tokens, render_assistant, render_pieces, render_tool_calls, render_tools)
from dsv32_jax.posttrain.chat.messages import (Assistant, Message, MessageLike, System, Tool, ToolCall, ToolLike, ToolResult,
                                     User, as_message, as_tool)
from dsv32_jax.posttrain.chat.parsing import decode_completion, parse_completion, parse_completion_ids
from dsv32_jax.posttrain.chat.tokens import (ASSISTANT, BOS, CALLS_CLOSE, CALLS_OPEN, DROP_MODES, DSML, EOS, INVOKE_CLOSE,
                                   INVOKE_OPEN, PAD, PARAM_CLOSE, PARAM_OPEN, RESULT_CLOSE, RESULT_OPEN, RESULTS_CLOSE,
                                   RESULTS_OPEN, SPECIAL_TOKENS, THINK_CLOSE, THINK_OPEN, USER, ChatFormatError,
                                   DropThinking, ToolsPrompt)

__all__ = [
    "ASSISTANT", "BOS", "CALLS_CLOSE", "CALLS_OPEN", "CHAT_TOKENIZER_PATH", "COMPACT_TOOLS_PROMPT", "DROP_MODES",
    "DSML", "EOS", "INVOKE_CLOSE", "INVOKE_OPEN", "PAD", "PARAM_CLOSE", "PARAM_OPEN", "PRINTABLE_CHARS", "RESULTS_CLOSE",
    "RESULTS_OPEN", "RESULT_CLOSE", "RESULT_OPEN", "SPECIAL_TOKENS", "THINK_CLOSE", "THINK_OPEN", "TINY_CHARS",
    "TOOLS_PROMPT", "USER", "Assistant", "ChatFormatError", "Codec", "DropThinking", "HFCodec", "Message",
    "MessageLike", "Piece", "System", "TinyCodec", "Tool", "ToolCall", "ToolLike", "ToolResult", "ToolsPrompt", "User",
    "as_message", "as_tool", "check_encodable", "decode_completion", "encode", "encode_assistant", "encode_parts", "encode_tokens", "load_tokenizer",
    "parse_completion", "parse_completion_ids", "render_assistant", "render_pieces", "render_tool_calls", "render_tools",
]
