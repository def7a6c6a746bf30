"""Tool calling as pure functions (issue 13, item 3): parsers of model output, prompt rendering,
``tool_choice`` grammars and request validation. The chat-completions serving module wires them."""
from .formats import FORMATS, UnknownToolParser
from .parsers import ToolCallStream, ToolParser, get_parser

__all__ = ["FORMATS", "ToolCallStream", "ToolParser", "UnknownToolParser", "get_parser"]
