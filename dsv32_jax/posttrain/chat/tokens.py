"""The chat format's special tokens, its error type and its option names (no other module of the package needed)."""

from __future__ import annotations

from typing import Literal, get_args

PAD = "<｜▁pad▁｜>"
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
DSML = "｜DSML｜"
CALLS_OPEN = f"<{DSML}function_calls>"
CALLS_CLOSE = f"</{DSML}function_calls>"
INVOKE_OPEN = f"<{DSML}invoke"
INVOKE_CLOSE = f"</{DSML}invoke>"
PARAM_OPEN = f"<{DSML}parameter"
PARAM_CLOSE = f"</{DSML}parameter>"
RESULTS_OPEN = "<function_results>"
RESULTS_CLOSE = "</function_results>"
RESULT_OPEN = "<result>"
RESULT_CLOSE = "</result>"

#: Every string the codecs of this package map to ONE id (TinyCodec ids 0..16 in this order; PAD is id 0).
SPECIAL_TOKENS: tuple[str, ...] = (
    PAD, BOS, EOS, USER, ASSISTANT, THINK_OPEN, THINK_CLOSE, CALLS_OPEN, CALLS_CLOSE, INVOKE_OPEN, INVOKE_CLOSE,
    PARAM_OPEN, PARAM_CLOSE, RESULTS_OPEN, RESULTS_CLOSE, RESULT_OPEN, RESULT_CLOSE,
)

DropThinking = Literal["after_user", "every_turn", "never"]
DROP_MODES = get_args(DropThinking)
ToolsPrompt = Literal["full", "compact"]


class ChatFormatError(ValueError):
    """A conversation that cannot be encoded, or a completion that does not parse; the message names where."""
