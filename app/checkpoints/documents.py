"""Documents as the checkpoints store them, and the writer they are published through.

A checkpoint line is `orjson.dumps(dataclasses.asdict(document))` plus a
newline, exactly as datatrove writes it, so either tool reads the other's
files. A document is datatrove's `Document` or this module's `Document`:
any dataclass with the fields `text`, `id`, `media` and `metadata`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

#: Documents whose metadata holds this key are checkpointed (they count
#: towards their chunk) but never written to the output: datatrove's marker
#: for a document whose rollouts were all dropped.
NO_ROLLOUTS_MARKER = "__no_rollouts_remove"


class DocumentError(ValueError):
    """A document that cannot be checkpointed; the message says what to fix."""


def json_default(obj: Any) -> Any:
    """What orjson cannot write itself, written as datatrove's `JsonlWriter` writes it (its `_json_default`):
    subclasses of date and time (pandas.Timestamp; NaT as null) in ISO form, numpy's bool, integer and
    float scalars as JSON's (NaN as null), datetime64 as its string. Anything else raises `TypeError`, as
    there. numpy is looked at only if the process has imported it: no value of it can exist otherwise."""
    import datetime
    import sys

    if isinstance(obj, datetime.date | datetime.time):
        return None if obj != obj else obj.isoformat()  # NaT is not equal to itself
    np: Any = sys.modules.get("numpy")
    if np is not None:
        if isinstance(obj, np.datetime64):
            return None if np.isnat(obj) else np.datetime_as_string(obj)
        if isinstance(obj, np.bool_):  # before integers: a bool stays a bool
            return bool(obj)
        if isinstance(obj, np.integer) and not isinstance(obj, np.timedelta64):
            return int(obj)
        if isinstance(obj, np.float16 | np.float32 | np.float64):  # longdouble has no exact JSON form
            return float(obj)
    raise TypeError(f"Type is not JSON serializable: {type(obj).__name__}")


@dataclass(slots=True)
class Document:
    """The project's own document, field for field datatrove's `Document`."""

    text: str
    id: str
    media: list[Any] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Document:
        """Build a document from one decoded checkpoint line."""
        return cls(
            text=data.get("text", ""),
            id=data["id"],
            media=list(data.get("media") or []),
            metadata=dict(data.get("metadata") or {}),
        )


class DocumentLike(Protocol):
    """What the checkpoint manager reads of a document (datatrove's `Document` fits)."""

    text: str
    id: str
    media: list[Any]
    metadata: dict[str, Any]


class OutputWriter(Protocol):
    """The three methods of datatrove's `DiskWriter` that checkpointing calls.

    A real datatrove `JsonlWriter` (used as a context manager) fits. A writer
    may also set `needs_documents = False` when it reads a chunk's documents
    from its checkpoint file itself: restoring checkpoints then keeps ids
    only, instead of writing every document of every unfinished chunk again.
    """

    def write(self, document: Any, rank: int = 0, **kwargs: Any) -> None: ...

    def close_file(self, original_name: str) -> None: ...

    def _get_output_filename(
        self, document: Any, rank: int | str = 0, chunk_index: int | None = None, **kwargs: Any
    ) -> str: ...


def is_removed(document: DocumentLike) -> bool:
    """True for a document that is checkpointed but left out of the output."""
    return NO_ROLLOUTS_MARKER in document.metadata


def encode_document(document: DocumentLike) -> bytes:
    """One checkpoint line, newline included, byte-identical to datatrove's.

    Raises `DocumentError` (and writes nothing) for a document that is not a
    dataclass, has a non-string id or text, or holds a value JSON cannot
    carry, such as raw `media_bytes`.
    """
    if not dataclasses.is_dataclass(document) or isinstance(document, type):
        raise DocumentError(
            f"a document must be a dataclass with text, id, media and metadata "
            f"(datatrove's Document or app.checkpoints.documents.Document), got {type(document).__name__}"
        )
    doc_id = getattr(document, "id", None)
    if not isinstance(doc_id, str):
        raise DocumentError(f"document id must be a str, got {type(doc_id).__name__} {doc_id!r}")
    if not isinstance(getattr(document, "text", None), str):
        raise DocumentError(f"document {doc_id!r}: text must be a str, got {type(document.text).__name__}")
    if not isinstance(document.metadata, dict):
        raise DocumentError(f"document {doc_id!r}: metadata must be a dict, got {type(document.metadata).__name__}")
    try:
        # orjson serialises slotted dataclasses field by field, in declaration
        # order, exactly like asdict() but without asdict's deep copy; other
        # dataclasses may carry extra attributes in __dict__, so they go
        # through asdict() to keep the line identical to datatrove's.
        if hasattr(type(document), "__slots__"):
            return orjson.dumps(document, option=orjson.OPT_APPEND_NEWLINE, default=json_default)
        return orjson.dumps(dataclasses.asdict(document), option=orjson.OPT_APPEND_NEWLINE, default=json_default)
    except TypeError as exc:
        raise DocumentError(_unserialisable_message(doc_id, document, exc)) from exc


def _unserialisable_message(doc_id: str, document: DocumentLike, exc: Exception) -> str:
    for i, media in enumerate(document.media):
        raw = media.get("media_bytes") if isinstance(media, dict) else getattr(media, "media_bytes", None)
        if isinstance(raw, bytes | bytearray | memoryview):
            return (
                f"document {doc_id!r}: media[{i}].media_bytes holds {len(raw)} raw bytes, which a JSON "
                f"checkpoint line cannot carry; base64-encode them into a str, or store the media "
                f"elsewhere and keep its path or url"
            )
    return f"document {doc_id!r} cannot be written as a JSON checkpoint line: {exc}"
