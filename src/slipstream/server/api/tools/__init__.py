"""Tool calling as pure functions (issue 13, item 3), wired in by the chat-completions serving
module: validate the request (:func:`check_tools`), make the messages renderable
(:func:`prepare_messages`), constrain the output when a call is required (:func:`grammar_for`),
read calls back (:func:`get_parser` → ``extract`` / ``stream``)."""
from .formats import FORMATS, ToolFormat, UnknownToolParser
from .grammar import grammar_for
from .parsers import ToolCallStream, ToolParser, get_parser
from .prompt import prepare_messages, render_calls, template_supports_tools, tools_system_prompt
from .validate import ToolCallError, check_tools, chosen_function, tool_names

__all__ = ["FORMATS", "ToolCallError", "ToolCallStream", "ToolFormat", "ToolParser", "UnknownToolParser",
           "check_tools", "chosen_function", "get_parser", "grammar_for", "prepare_messages",
           "render_calls", "template_supports_tools", "tool_names", "tools_system_prompt"]
