"""Chat messages as a chat template takes them: one check and one normal form for `LLM.chat` and `graphkiln serve`.

Messages follow the OpenAI API's shape: a role, content as a string or a list of text parts (joined into one
string, since templates take strings), an optional name. Anything else (an unknown role, missing content,
tool calls, images) is a RequestError naming the message and field, never text a template renders as is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from graphkiln.errors import RequestError

ROLES = ("system", "user", "assistant", "developer", "tool")
MESSAGE_FIELDS = ("role", "content", "name")


def template_messages(messages: Sequence[Mapping], where: str = "messages") -> list[dict]:
    """`messages` checked and normalised to {"role", "content": str, "name"?} dicts; errors name `where`.N.field."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise RequestError(f"{where}={messages!r:.80}: give a list of messages, each a dict with role and content")
    if not messages:
        raise RequestError(f"{where} is empty; give at least one message")
    return [_template_message(m, f"{where}.{i}") for i, m in enumerate(messages)]


def _template_message(message: Mapping, where: str) -> dict:
    if not isinstance(message, Mapping):
        raise RequestError(f"{where}={message!r:.80}: give a dict with role and content")
    unknown = sorted(map(str, set(message) - set(MESSAGE_FIELDS)))
    if unknown:
        raise RequestError(f"{where}.{unknown[0]}: unknown field; a message takes {', '.join(MESSAGE_FIELDS)}")
    role = message.get("role")
    if role not in ROLES:
        got = "missing" if "role" not in message else f"{role!r:.80} is not a role"
        raise RequestError(f"{where}.role: {got}; give one of {', '.join(ROLES)}")
    name = message.get("name")
    if name is not None and not isinstance(name, str):
        raise RequestError(f"{where}.name={name!r:.80}: give a string, or leave it out")
    normal = {"role": role, "content": _text(message.get("content"), f"{where}.content")}
    return normal | ({"name": name} if name else {})


def _text(content, where: str) -> str:
    """A message's content as one string: a string as it is, text parts joined."""
    if isinstance(content, str):
        return content
    hint = 'give a string or a list of text parts ({"type": "text", "text": ...})'
    if content is None:
        raise RequestError(f"{where}: missing; {hint}")
    if isinstance(content, (bytes, Mapping)) or not isinstance(content, Sequence):
        raise RequestError(f"{where}={content!r:.80}: {hint}")
    for i, part in enumerate(content):
        if not (isinstance(part, Mapping) and set(part) == {"type", "text"} and part["type"] == "text"
                and isinstance(part["text"], str)):  # fmt: skip
            raise RequestError(f"{where}.{i}={part!r:.80}: {hint}")
    return "".join(part["text"] for part in content)
