"""Recognising a satlab checkpoint before anything in it is unpickled.

A checkpoint is a pickle inside torch.save's zip archive, and unpickling runs whatever the pickle names. So a file
satlab is given is scanned first: its ``data.pkl`` is parsed with ``pickletools`` (which runs nothing), every global
it references must be one a satlab checkpoint holds, and it must carry the ``satlab`` entry's strings. Only then is
it loaded, with ``weights_only=True``. A sharded directory's shard index ``.metadata`` is scanned the same way:
``torch.distributed.checkpoint`` reads it with a plain ``pickle.load``. See docs/checkpoints.md.
"""

from __future__ import annotations

import pickletools
import re
import zipfile
from pathlib import Path
from typing import Any

import torch

KEY = "satlab"
"""The key of satlab's entry (config and tokenizer) in every checkpoint, and the marker the scan looks for."""


class NotSatlabCheckpoint(ValueError):
    """What the scan of a file found instead of a satlab checkpoint; nothing of the file was unpickled."""


CHECKPOINT_GLOBALS = frozenset({
    # All that satlab checkpoints reference (found by scanning the last.ckpt and step*.ckpt of a tiny training, the
    # meta.pt of model_parallel and fsdp checkpoints, and the weights of every architecture in fp32 and bf16):
    "collections.OrderedDict",  # state dicts, and every tensor's (empty) hooks
    "torch._utils._rebuild_tensor_v2",  # every tensor
    # The legacy storage classes torch.save names a tensor's dtype by (torch's weights_only allowlist admits them
    # all): fp32/bf16/fp16 weights (train.precision), int64 steps and positions, uint8 RNG states, and the other
    # classic dtypes a model's buffers may have.
    *(f"torch.{dtype}Storage" for dtype in ("Float", "BFloat16", "Half", "Double", "Long", "Int", "Short", "Char",
                                            "Byte", "Bool")),
})
"""The globals (``module.name``) a satlab checkpoint file may reference: everything else is refused unread."""
SHARD_INDEX_GLOBALS = frozenset({
    # What torch.distributed.checkpoint's FileSystemWriter pickles into .metadata (found by scanning the index of
    # model_parallel and fsdp checkpoints with weights, optimizer and scheduler states):
    *(f"torch.distributed.checkpoint.metadata.{name}" for name in (
        "Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")),
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.Size", "torch.serialization._get_layout",  # a tensor's shape and layout (torch.strided)
    "pathlib.PosixPath", "pathlib._local.PosixPath",  # StorageMeta.checkpoint_id (the latter from Python 3.13)
    *(f"torch.{name}" for name, value in vars(torch).items() if isinstance(value, torch.dtype)),  # tensor dtypes
})
"""The globals a shard index may reference (classes of plain data, as the checkpoint files' above)."""
SATLAB_MARKER = frozenset({KEY, "config", "tokenizer"})
"""String constants every satlab checkpoint's pickle holds: the keys of the entry :func:`satlab_entry` writes."""
_STRINGS = frozenset({"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE",
                      "BINUNICODE8"})
_MARK = object()


def _last_mark(stack: list) -> int:
    """The index of the topmost mark on ``stack`` (0 when there is none: everything goes)."""
    return next((i for i in range(len(stack) - 1, -1, -1) if stack[i] is _MARK), 0)


def pickle_globals(data: bytes) -> tuple[set[str], set[str]]:
    """(the globals, the string constants) of the pickle ``data``, from its opcodes alone (``pickletools.genops``
    parses, never runs them). STACK_GLOBAL takes its module and name from the stack, which may come from the memo,
    so the stack and memo are followed as ``pickletools.dis`` does, holding strings and None for anything else; a
    global whose name is not two such strings (or an extension code, EXT1/2/4) is "?". ValueError if malformed."""
    stack: list = []
    memo: dict = {}
    found: set[str] = set()
    strings: set[str] = set()
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):  # stores the top of the stack, which stays
            memo[len(memo) if op.name == "MEMOIZE" else arg] = stack[-1] if stack else None
            continue
        before = op.stack_before
        if pickletools.markobject in before or (op.name == "POP" and stack and stack[-1] is _MARK):
            del stack[_last_mark(stack):]  # everything above the mark, and the mark
            before = before[:before.index(pickletools.markobject)] if pickletools.markobject in before else []
        cut = max(0, len(stack) - len(before))
        taken, after = stack[cut:], [None] * len(op.stack_after)
        del stack[cut:]
        if op.name in _STRINGS:
            strings.add(arg)
            after = [arg]
        elif op.name in ("GET", "BINGET", "LONG_BINGET"):
            after = [memo.get(arg)]
        elif op.name in ("GLOBAL", "INST"):
            found.add(arg.replace(" ", "."))
        elif op.name == "STACK_GLOBAL":
            named = len(taken) == 2 and all(isinstance(part, str) for part in taken)
            found.add(".".join(taken) if named else "?")
        elif op.name.startswith("EXT"):
            found.add("?")
        elif pickletools.markobject in op.stack_after:
            after = [_MARK]
        stack.extend(after)
    return found, strings


def pickle_problem(data: bytes, allowed: frozenset[str], holder: str,
                   marker: frozenset[str] = frozenset()) -> str | None:
    """None when the pickle ``data`` references only ``allowed`` globals and holds the ``marker`` strings, else why
    not, as a predicate ("references os.system, which no <holder> contains"). A name comes from the file, so it is
    shown only if it looks like one."""
    try:
        found, strings = pickle_globals(data)
    except Exception:  # genops raises ValueError and others on a malformed or cut-off pickle
        return "holds a malformed pickle"
    for name in sorted(found - allowed):
        shown = name if re.fullmatch(r"[\w.]{1,120}", name) else "an object it names only at load time"
        return f"references {shown}, which no {holder} contains"
    if not marker <= strings:
        return f"is a PyTorch file but not a {holder} (no '{KEY}' entry with config and tokenizer)"
    return None


def _not_an_archive(path: Path) -> str:
    """Why ``path``, which is no zip archive, is no torch.save file, from its first bytes."""
    with open(path, "rb") as file:
        head = file.read(4096)
    if not head:
        return "it is empty"
    if head.startswith(b"PK\x03\x04"):
        return "it is a cut-off or damaged zip archive (a write or copy that did not finish?)"
    if head.startswith(b"\x80"):
        return "it is a plain pickle, not a PyTorch checkpoint archive"
    try:
        head.decode("utf-8")  # a cut in the middle of a character is a few bytes from the end
        text = b"\0" not in head
    except UnicodeDecodeError as error:
        text = error.start >= len(head) - 3 and b"\0" not in head
    return "it is not a PyTorch checkpoint archive" + (" (a text file?)" if text else "")


def inspect_checkpoint_file(path: Path) -> str | None:
    """None when ``path`` looks like a satlab checkpoint file (or a sharded one's ``meta.pt``), else why not, found
    without unpickling anything: it must be a zip archive as torch.save writes it (one folder holding ``data.pkl``),
    whose pickle references only :data:`CHECKPOINT_GLOBALS` and holds the strings of the ``satlab`` entry."""
    path = Path(path)
    if not zipfile.is_zipfile(path):
        return _not_an_archive(path)
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            folder = names[0].split("/")[0] if names else ""
            # one name twice could be read by torch's zip reader as the other entry than the one scanned here
            if (not folder or any(name.split("/")[0] != folder for name in names) or len(set(names)) < len(names)
                    or f"{folder}/data.pkl" not in names):
                return "it is a zip archive but not one torch.save writes (one folder with data.pkl)"
            data = archive.read(f"{folder}/data.pkl")
    except (zipfile.BadZipFile, EOFError, NotImplementedError, ValueError):
        return "it is a damaged zip archive (a write or copy that did not finish?)"
    problem = pickle_problem(data, CHECKPOINT_GLOBALS, "satlab checkpoint", SATLAB_MARKER)
    return problem and f"it {problem}"


def inspect_shard_index(path: Path) -> str | None:
    """None when a sharded checkpoint's index ``path`` (``.metadata``) references only :data:`SHARD_INDEX_GLOBALS`,
    else why not. ``FileSystemReader.read_metadata`` reads it with a plain ``pickle.load`` (torch 2.13), which runs
    whatever a hostile index references, so it is scanned first; ``weights_only`` does not apply there."""
    problem = pickle_problem(path.read_bytes(), SHARD_INDEX_GLOBALS, "shard index")
    return problem and f"its shard index {path.name} {problem}"


def _without_unsafe_advice(message: str) -> str:
    """The first line of torch's error, without its advice to load with ``weights_only=False`` (which would run
    what the file holds; no satlab checkpoint needs it) or its terminal colour codes, plus the global it names."""
    first = re.sub(r"\x1b\[[0-9;]*m", "", message.strip().split("\n")[0])
    kept = " ".join(sentence for sentence in re.split(r"(?<=\.)\s+", first)
                    if not re.search(r"weights_only|can still be loaded|trust", sentence)).strip()
    kept = kept or "torch refused to load it"
    if named := re.search(r"GLOBAL ([\w.]{1,120})", message):  # the one useful part of the rest
        kept = f"{kept.rstrip('.')}: it references {named[1]}"
    return kept


def load_checkpoint_file(path: Path, map_location: Any = "cpu", mmap: bool = False) -> dict:
    """``torch.load`` (``weights_only=True``) of a file that :func:`inspect_checkpoint_file` accepts, else
    NotSatlabCheckpoint with nothing unpickled. Should torch still fail, its error says why without its advice."""
    if problem := inspect_checkpoint_file(path):
        raise NotSatlabCheckpoint(problem)
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as error:
        error.args = (_without_unsafe_advice(str(error)),)
        raise


def cannot_read(path: Path | str, error: Exception) -> str:
    """satlab's message for a checkpoint that ``error`` kept from being read."""
    if isinstance(error, NotSatlabCheckpoint):
        return f"'{path}' cannot be read as a satlab checkpoint: {error}; nothing in it was unpickled"
    return f"checkpoint '{path}' cannot be read ({type(error).__name__}: {error})"
