"""Crash-safe checkpoint files: atomic writes, a checksum, and finding the newest good one.

A training job killed at any instant (SIGKILL, OOM killer, preemption, power loss after the
write returned) must leave behind either the previous checkpoint or the new one, never a
half-written file that looks like a good one. This module gives that guarantee:

* :func:`save_checkpoint` serialises the state with ``torch.save`` into memory first (so a state
  that cannot be pickled raises before anything touches the disk), writes it to a temporary file
  in the target's directory, flushes and ``fsync``\\ s it, renames it onto the target with
  ``os.replace`` (atomic on POSIX and Windows within one file system) and ``fsync``\\ s the
  directory, so the rename itself is durable.
* Every file carries a 56-byte header: the magic ``b"MPEXTCKP"``, the format version (uint32),
  a flags word (uint32, 0), the payload length (uint64) and the SHA-256 of the payload, all
  little-endian; the ``torch.save`` bytes follow. A truncated file, a file with trailing bytes
  and any flipped bit are detected by :func:`verify_checkpoint` / :func:`load_checkpoint`, which
  raise :class:`CheckpointError` naming the file and what is wrong.
* :func:`latest_checkpoint` returns the newest file in a directory that matches a pattern and
  verifies, skipping corrupt files and the temporary files of interrupted writes.

Usage::

    import mpext.checkpoint as ckpt

    ckpt.save_checkpoint(f"run/step_{step:08d}.pt", {
        "step": step, "model": model.state_dict(), "optimizer": opt.state_dict(),
        "scaler": scaler.state_dict()})
    ...
    path = ckpt.latest_checkpoint("run", "step_*.pt")
    if path is not None:
        state = ckpt.load_checkpoint(path)
"""
import fnmatch
import hashlib
import io
import os
import re
import struct
import uuid
from typing import Any, Callable, Dict, Optional, Union

import torch

__all__ = ["CheckpointError", "FORMAT_VERSION", "save_checkpoint", "load_checkpoint",
           "verify_checkpoint", "latest_checkpoint", "is_temporary_file"]

FORMAT_VERSION = 1
_MAGIC = b"MPEXTCKP"
_HEADER = struct.Struct("<8sIIQ32s")  # magic, version, flags, payload length, sha256(payload)
HEADER_SIZE = _HEADER.size  # 56
_TMP_SUFFIX = ".mpext-tmp"
_WRITE_CHUNK = 1 << 24  # bytes per write call (16 MiB): bounded calls for huge payloads

PathLike = Union[str, "os.PathLike[str]"]


class CheckpointError(RuntimeError):
    """A checkpoint file is missing its header, truncated, has trailing bytes, fails its
    checksum, or has an unsupported format version."""


def is_temporary_file(name: PathLike) -> bool:
    """Whether ``name`` (a path or a file name) is a temporary file left by an interrupted
    :func:`save_checkpoint`. Such files are never taken for checkpoints and may be deleted."""
    return os.path.basename(os.fspath(name)).endswith(_TMP_SUFFIX)


def _check_path(path: Any, arg: str = "path") -> str:
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
        raise TypeError("mpext.checkpoint: %s must be a str or os.PathLike, got %s"
                        % (arg, type(path).__name__))
    path = os.fspath(path)
    if not path:
        raise ValueError("mpext.checkpoint: %s must not be empty" % arg)
    return path


def _fsync_directory(directory: str) -> None:
    """Makes a rename in ``directory`` durable. Not possible on Windows (a directory cannot be
    opened), where the rename is durable once the file system's journal commits."""
    if os.name == "nt":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(path: PathLike, state: Dict[str, Any]) -> None:
    """Atomically writes ``state`` (a dict, serialised with ``torch.save``) to ``path``.

    The bytes go to a temporary file ``.<name>.<random>.mpext-tmp`` in the same directory, which
    is flushed and ``fsync``\\ ed, then renamed onto ``path`` with ``os.replace``; the directory
    is ``fsync``\\ ed after the rename. Killed at any point, the call leaves ``path`` either as it
    was or holding the complete new checkpoint (plus, at worst, a stray temporary file, which
    :func:`latest_checkpoint` ignores). The file starts with a header holding the format version
    and the SHA-256 of the payload, so :func:`load_checkpoint` detects truncation and corruption.

    Args:
        path: the checkpoint file to create or replace; its directory must exist.
        state: a dict of what to save (state dicts of the model, optimizer, scaler, the step,
            ...). It is serialised in memory first: if it cannot be serialised the error is
            raised before anything is written.

    Raises:
        TypeError: ``path`` is not a path, or ``state`` is not a dict.
        FileNotFoundError: the directory of ``path`` does not exist.
        IsADirectoryError: ``path`` is a directory.
    """
    path = _check_path(path)
    if not isinstance(state, dict):
        raise TypeError("mpext.checkpoint.save_checkpoint: state must be a dict, got %s"
                        % type(state).__name__)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError("mpext.checkpoint.save_checkpoint: the directory of path %r "
                                "does not exist (%r)" % (path, directory))
    if os.path.isdir(path):
        raise IsADirectoryError("mpext.checkpoint.save_checkpoint: path %r is a directory"
                                % (path,))

    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getbuffer()
    header = _HEADER.pack(_MAGIC, FORMAT_VERSION, 0, len(payload),
                          hashlib.sha256(payload).digest())

    # (the name cut to 200 characters keeps the temporary name within NAME_MAX = 255)
    tmp = os.path.join(directory, ".%s.%s%s" % (os.path.basename(path)[:200],
                                                  uuid.uuid4().hex, _TMP_SUFFIX))
    try:
        with open(tmp, "xb") as f:
            f.write(header)
            for start in range(0, len(payload), _WRITE_CHUNK):
                f.write(payload[start:start + _WRITE_CHUNK])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_directory(directory)


def _read_verified(path: str, who: str) -> bytes:
    """The payload of the checkpoint file at ``path``, after checking its header, length and
    checksum; raises CheckpointError otherwise."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < HEADER_SIZE:
        if len(data) >= len(_MAGIC) and not data.startswith(_MAGIC):
            raise CheckpointError("%s: %r is not an mpext checkpoint (no mpext header; files "
                                  "written by torch.save load with torch.load)" % (who, path))
        raise CheckpointError("%s: %r is truncated: %d bytes, shorter than the %d-byte header"
                              % (who, path, len(data), HEADER_SIZE))
    magic, version, flags, length, digest = _HEADER.unpack_from(data)
    if magic != _MAGIC:
        raise CheckpointError("%s: %r is not an mpext checkpoint (no mpext header; files "
                              "written by torch.save load with torch.load)" % (who, path))
    if version != FORMAT_VERSION or flags != 0:
        raise CheckpointError("%s: %r has format version %d, flags %#x; this mpext reads "
                              "version %d, flags 0 (a newer mpext wrote it, or the header is "
                              "corrupt)" % (who, path, version, flags, FORMAT_VERSION))
    actual = len(data) - HEADER_SIZE
    if actual != length:
        raise CheckpointError("%s: %r is %s: the header promises %d payload bytes, the file "
                              "holds %d" % (who, path, "truncated" if actual < length
                                            else "corrupt (trailing bytes)", length, actual))
    payload = memoryview(data)[HEADER_SIZE:]
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError("%s: %r is corrupt: the SHA-256 of its payload does not match "
                              "the header" % (who, path))
    return payload


def verify_checkpoint(path: PathLike) -> None:
    """Checks that ``path`` is a complete, uncorrupted checkpoint written by
    :func:`save_checkpoint` (header, format version, length and SHA-256), without unpickling it.

    Raises:
        CheckpointError: the file is not an mpext checkpoint, is truncated, has trailing bytes,
            fails its checksum or has an unsupported format version.
        FileNotFoundError: there is no such file.
    """
    path = _check_path(path)
    _read_verified(path, "mpext.checkpoint.verify_checkpoint")


def load_checkpoint(path: PathLike, map_location: Any = None, *,
                    weights_only: bool = True) -> Dict[str, Any]:
    """Reads a checkpoint written by :func:`save_checkpoint`, verifying it before unpickling.

    Args:
        path: the checkpoint file.
        map_location: as for ``torch.load`` (e.g. ``"cpu"`` to load a GPU checkpoint on a
            machine without one).
        weights_only: as for ``torch.load``: True (default) unpickles only tensors, primitive
            types and containers, which is all model, optimizer and scaler state dicts hold;
            pass False only for a file from a trusted source that holds other objects.

    Returns:
        the dict that was saved.

    Raises:
        CheckpointError: the file is not an mpext checkpoint, is truncated, has trailing bytes,
            fails its checksum or has an unsupported format version. Nothing is unpickled from
            a file that fails these checks.
        FileNotFoundError: there is no such file.
    """
    path = _check_path(path)
    payload = _read_verified(path, "mpext.checkpoint.load_checkpoint")
    state = torch.load(io.BytesIO(payload), map_location=map_location, weights_only=weights_only)
    if not isinstance(state, dict):  # save_checkpoint only writes dicts
        raise CheckpointError("mpext.checkpoint.load_checkpoint: %r holds a %s, not a dict"
                              % (path, type(state).__name__))
    return state


_DIGITS = re.compile(r"(\d+)")


def _natural_key(name: str):
    """'step_10.pt' after 'step_9.pt': digit runs compare as numbers."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part)
            for part in _DIGITS.split(name)]


def latest_checkpoint(directory: PathLike, pattern: str = "*",
                      key: Optional[Callable[[str], Any]] = None) -> Optional[str]:
    """The newest checkpoint in ``directory`` whose file name matches ``pattern`` and that
    verifies (see :func:`verify_checkpoint`), or None if there is none.

    Corrupt or truncated files are skipped (the next newest is tried), and so are the temporary
    files of interrupted :func:`save_checkpoint` calls, even when ``pattern`` matches them.

    Args:
        directory: where to look (not recursive).
        pattern: a shell-style pattern (``fnmatch``) for the file names, e.g. ``"step_*.pt"``.
        key: orders the candidates; the greatest is the newest. It is given the file's path.
            Default: the file name with its digit runs compared as numbers, so
            ``step_10.pt`` is newer than ``step_9.pt`` (name checkpoints by step; file
            modification times can tie or go backwards). ``os.path.getmtime`` orders by time.

    Returns:
        the path (``os.path.join(directory, name)``) of the newest good checkpoint, or None.

    Raises:
        FileNotFoundError / NotADirectoryError: ``directory`` does not exist or is not a
            directory.
    """
    directory = _check_path(directory, "directory")
    if not isinstance(pattern, str) or not pattern:
        raise TypeError("mpext.checkpoint.latest_checkpoint: pattern must be a non-empty str, "
                        "got %r" % (pattern,))
    if key is not None and not callable(key):
        raise TypeError("mpext.checkpoint.latest_checkpoint: key must be callable or None, got "
                        "%s" % type(key).__name__)
    candidates = [os.path.join(directory, name) for name in os.listdir(directory)
                  if fnmatch.fnmatch(name, pattern) and not is_temporary_file(name)]
    candidates = [p for p in candidates if os.path.isfile(p)]
    order = key if key is not None else (lambda p: _natural_key(os.path.basename(p)))
    for path in sorted(candidates, key=order, reverse=True):
        try:
            _read_verified(path, "mpext.checkpoint.latest_checkpoint")
        except (CheckpointError, OSError):  # corrupt, or removed while we looked
            continue
        return path
    return None
