"""Server-sent events: turn the lines of a /generate_stream body into event payloads."""
from __future__ import annotations

from typing import Iterable, Iterator


class SSEDecoder:
    """Incremental decoder: feed it lines, get the `data` payload of each completed event."""

    def __init__(self):
        self._data: list[str] = []

    def feed(self, line: str | bytes) -> str | None:
        if isinstance(line, bytes):
            line = line.decode("utf-8")
        line = line.rstrip("\r\n")
        if not line:  # a blank line ends the event
            return self.flush()
        if line.startswith(":"):  # comment / keep-alive
            return None
        field, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data.append(value)
        return None  # event:, id:, retry: carry nothing Triton uses

    def flush(self) -> str | None:
        """End of stream counts as the end of an unterminated event."""
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data


def iter_events(lines: Iterable[str | bytes]) -> Iterator[str]:
    """Payloads of all events in `lines`, including a last one the server did not terminate."""
    decoder = SSEDecoder()
    for line in lines:
        data = decoder.feed(line)
        if data is not None:
            yield data
    data = decoder.flush()
    if data is not None:
        yield data
