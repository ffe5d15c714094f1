"""The journaled, atomic writer of a checkpoint directory (``write_checkpoint``), shared by
``save_pretrained`` (saving/pretrained.py) and ``autoxla quantize``: written atomically, never
touching a file it did not write.

The directory is a normal transformers checkpoint (config.json + safetensors shards + index) whose
config.json also holds ``quantization_config`` when the model is quantized, so
``from_pretrained(dir)`` loads the quantized tensors as they are, without quantizing again.

What a save replaces. By design (as transformers' own save_pretrained does) a save replaces
config.json, generation_config.json (when the model has a generation config), model.safetensors,
model.safetensors.index.json and the weight files the previous index names; the stale half of a
change of layout goes too (single -> sharded removes the old model.safetensors, sharded -> single
the old index and the shards it named), or the loader, which prefers the index, would read the old
weights. Every other file is kept byte for byte: tokenizer files, a README, another tool's
``model-final.safetensors`` or ``model-00001-of-00002.safetensors`` that no index names, dot-files
that look like our temporaries, subdirectories. Nothing is recognised by a name pattern: the
previous checkpoint is what its own index says (names used only if they are plain file names
ending in ``.safetensors``: no ``/``, ``\\``, ``..``; others are kept, with a warning), and a
save's own temporaries are what its journal says. When a shard name this save would use belongs
to a file no index names, the shards are named ``model-00001-of-00003-<token>.safetensors``
instead (the index says which files are the checkpoint).

The journal. Before it creates anything a save writes ``.autoxla-save-<token>.json`` (created
exclusively, fsync'ed, locked with flock while the save runs) listing every name it will create,
all carrying its random token: the temporaries ``.<name>.tmp-<token>``, the backups of the files
it replaces or removes ``.<name>.autoxla-old-<token>`` (config.json's is
``config.json.autoxla-previous`` when that name is free), and the final names. Then:

1. every new file is written under its temporary name and fsync'ed;
2. the journal is renamed ``.autoxla-commit-<token>.json``: the commit begins;
3. config.json is moved aside: from here to step 5 the directory does not load (from_pretrained
   refuses it: no config.json);
4. every previous file the save replaces or removes is moved aside to its backup, then the new
   weight files, index and generation config are renamed into place;
5. the new config.json is renamed into place: the commit point, the directory loads the new
   checkpoint;
6. the backups and the journal are removed.

Moves to a fresh name use ``os.rename`` (it refuses to replace a file on Windows, which is the
point: those names are ours and free), installs over a final name ``os.replace``.

Failures. An exception at any step before 5 (an OSError, a full disk, KeyboardInterrupt) rolls back
and propagates: the new files and temporaries are removed and the backups moved back, so the
directory holds the previous checkpoint as it was. After 5 the save has happened: removing the
backups is retried once and, if it still fails, reported with a warning, the journal kept for the
next save. If the rollback itself fails, the journal is kept, the directory holds the previous
checkpoint or is refused (no config.json), and the exception carries a note saying so.

Kills. A killed save leaves its journal. The next save into the directory first settles it: a
``.autoxla-save-`` journal (killed while staging) has its temporaries removed; a
``.autoxla-commit-`` journal is rolled back (previous checkpoint restored) if its config.json
temporary still exists, else finished (backups removed). Only the names a journal lists are
touched, and only if they have the forms above with the journal's own token; a journal torn while
being written (no temporary exists yet then) is recognised by its content (empty, or the start of
what a journal holds, with the same token) and removed, any other
file with a journal's name is kept, with a warning. Leftovers of AutoXLA versions before the
journal have no journal and are kept: delete them by hand. A second save into a directory while
one runs raises SaveInProgressError (where flock exists; two saves starting in the same instant
are not detected: one writer per directory). generation_config.json is kept as it is when the
model has no generation config.
"""
from __future__ import annotations

import json
import operator
import os
import re
import secrets
import warnings
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path

from .._native import file_kind

try:
    import fcntl
except ImportError:   # pragma: no cover - Windows: no concurrent-save detection
    fcntl = None

CONFIG = "config.json"
# The weight files of a checkpoint, as transformers names them (the loader reads these names too).
SAFE_INDEX, SAFE_SINGLE = "model.safetensors.index.json", "model.safetensors"
GENERATION_CONFIG = "generation_config.json"
_PREVIOUS_CONFIG = CONFIG + ".autoxla-previous"
_REPLACED = (CONFIG, GENERATION_CONFIG, SAFE_SINGLE, SAFE_INDEX)   # replaced by design
_DEFAULT_SHARD = 2 * 2**30
_MAX_SHARD = 2**62
_MAGIC = "autoxla-save-journal"
_STAGING = re.compile(r"^\.autoxla-save-([0-9a-f]{16})\.json$")
_COMMITTING = re.compile(r"^\.autoxla-commit-([0-9a-f]{16})\.json$")


def _journal_name(token: str, committing: bool = False) -> str:
    """The journal's name while staging, or once its commit began (what _STAGING /
    _COMMITTING match)."""
    return f".autoxla-{'commit' if committing else 'save'}-{token}.json"


class SaveInProgressError(RuntimeError):
    """Another save_pretrained is writing into the same directory right now."""


def interrupted_save(directory: str | os.PathLike) -> bool:
    """Whether a save_pretrained into ``directory`` was interrupted and not yet settled (its
    journal, or the config it moved aside, is still there); the next save settles it."""
    d = Path(directory)
    if not d.is_dir():
        return False
    return _exists(d / _PREVIOUS_CONFIG) or any(
        _STAGING.match(p.name) or _COMMITTING.match(p.name) for p in d.iterdir())



_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]I?B|B)?$", re.IGNORECASE)
_SIZE_HELP = ("pass a positive number of bytes (e.g. 500000000) or a string such as '2GB', "
              "'500MB' or '1.5GiB'")


def parse_size(size) -> int:
    """``max_shard_size`` in bytes: a positive int, or a decimal number with an optional unit
    (B, KB/MB/GB/TB = powers of 10, KiB/MiB/GiB/TiB = powers of 2); at most 2**62."""
    if isinstance(size, bool):
        raise ValueError(f"max_shard_size={size!r} is a bool, not a size; {_SIZE_HELP}")
    if isinstance(size, str):
        text = size.strip()
        m = _SIZE.match(text)
        if m is None:
            why = "is negative" if text.startswith("-") else "is not a size"
            raise ValueError(f"max_shard_size={size!r} {why}; {_SIZE_HELP}")
        whole, _, fraction = m.group(1).partition(".")
        whole = whole.lstrip("0")
        if len(whole) > 20:        # >= 1e20 bytes whatever the unit: no limit in practice
            value = _MAX_SHARD
        else:
            exact = Fraction(f"{whole or '0'}.{fraction[:30] or '0'}")
            value = int(exact * _UNITS[(m.group(2) or "B").upper()])
    else:
        try:
            value = operator.index(size)
        except TypeError:
            raise ValueError(f"max_shard_size={size!r} ({type(size).__name__}) is not a size; "
                             f"{_SIZE_HELP}") from None
    if value < 1:
        raise ValueError(f"max_shard_size={size!r} is {value} bytes; a shard limit must be at "
                         f"least 1 byte: {_SIZE_HELP}")
    return min(value, _MAX_SHARD)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:   # Windows cannot open a directory; its renames are durable without this
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _exists(path: Path) -> bool:
    return os.path.lexists(path)


def _retry(op, *args) -> None:
    """Cleanup and rollback try each step twice: a transient error must not leave debris."""
    try:
        op(*args)
    except OSError:
        op(*args)


def _remove(path: Path) -> None:
    if _exists(path):
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        except OSError:
            if _exists(path):
                os.unlink(path)


def _plain_name(name) -> bool:
    """A file name inside the directory: no separator, no '..', nothing that leaves it."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name
            and "\\" not in name and "\0" not in name and os.path.basename(name) == name)


def _final_name(name) -> bool:
    """A name a checkpoint of ours may have: the fixed ones, or a plain *.safetensors name."""
    return _plain_name(name) and (name in _REPLACED or name.endswith(".safetensors"))


def _temp_name(final: str, token: str) -> str:
    return f".{final}.tmp-{token}"


def _backup_name(final: str, token: str) -> str:
    return f".{final}.autoxla-old-{token}"


@dataclass(frozen=True)
class _Entry:
    """One final name of a save: written from ``temp`` (None: only removed) and, when a previous
    file had that name, moved aside to ``backup`` until the commit is done."""

    final: str
    temp: str | None
    backup: str | None


def _previous_weights(target: Path) -> list[str]:
    """The weight files of the checkpoint in ``target``: model.safetensors, the index and exactly
    the files that index names (checked to be plain *.safetensors file names in ``target``)."""
    names = [n for n in (SAFE_SINGLE, SAFE_INDEX) if _exists(target / n)]
    if SAFE_INDEX not in names:
        return names
    index = target / SAFE_INDEX
    try:
        if not index.is_file():   # reading a FIFO would block the save forever
            raise OSError(f"it is {file_kind(os.stat(index).st_mode)}")
        listed = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        warnings.warn(f"{index} is not a readable index ({type(e).__name__}: {e}); it is replaced, "
                      "the weight files it may name are kept: delete them by hand if stale",
                      stacklevel=3)
        return names
    refused = []
    for name in sorted(listed, key=str):
        if not (_plain_name(name) and name.endswith(".safetensors")):
            refused.append(name)
            continue
        path = target / name
        if not _exists(path):
            continue   # listed but absent: nothing to replace
        if not (path.is_file() or path.is_symlink()):
            refused.append(name)
        elif name not in names:
            names.append(name)
    if refused:
        warnings.warn(f"{index} names {refused[:3]}, which are not weight files in {target} (a "
                      "plain *.safetensors file name is expected); they are kept", stacklevel=3)
    return names


def _plan(target: Path, n_shards: int, writes_generation: bool):
    """(token, shard names, entries): every name this save creates, replaces or removes."""
    previous = [CONFIG] if _exists(target / CONFIG) else []
    if writes_generation and _exists(target / GENERATION_CONFIG):
        previous.append(GENERATION_CONFIG)
    previous += _previous_weights(target)
    for name in previous:
        path = target / name
        if path.is_dir() and not path.is_symlink():
            raise ValueError(f"{path} is a directory where save_pretrained writes a file; move it "
                             "out of the way or save into another directory")
    standard = [f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors" for i in range(n_shards)]
    foreign = [n for n in standard if _exists(target / n) and n not in previous]
    for _ in range(64):
        token = secrets.token_hex(8)
        if n_shards == 1:
            shards = [SAFE_SINGLE]
        elif foreign:   # another tool's files have our names: never overwrite them
            shards = [f"model-{i + 1:05d}-of-{n_shards:05d}-{token}.safetensors"
                      for i in range(n_shards)]
        else:
            shards = standard
        finals = shards + ([SAFE_INDEX] if n_shards > 1 else [])
        finals += [GENERATION_CONFIG] if writes_generation else []
        finals.append(CONFIG)
        config_backup = (_PREVIOUS_CONFIG if not _exists(target / _PREVIOUS_CONFIG)
                         else _backup_name(CONFIG, token))
        entries = []
        for name in finals + [n for n in previous if n not in finals]:
            backup = None
            if name in previous:
                backup = config_backup if name == CONFIG else _backup_name(name, token)
            entries.append(_Entry(name, _temp_name(name, token) if name in finals else None,
                                  backup))
        created = [e.temp for e in entries if e.temp] + [e.backup for e in entries if e.backup]
        created += [_journal_name(token), _journal_name(token, committing=True)]
        created += shards if shards[0] not in (SAFE_SINGLE, standard[0]) else []
        if not any(_exists(target / n) for n in created):
            return token, shards, entries
    raise FileExistsError(f"no free names for a save in {target}")   # pragma: no cover


def _settle(target: Path, entries: list[_Entry], committing: bool) -> None:
    """Undo or finish a save from its journal; idempotent, so a kill inside it is settled by the
    next call. Staging: remove the temporaries. Committing, before the new config.json is in place
    (its temporary exists): remove what was installed and temporaries, move the backups back,
    config.json last, the config temporary after it (it tells the phase). After: remove backups."""
    config = next(e for e in entries if e.final == CONFIG)
    if not committing:
        for e in entries:
            if e.temp:
                _remove(target / e.temp)
        _retry(_fsync_dir, target)
        return
    if _exists(target / config.temp):
        for e in reversed([e for e in entries if e is not config]):
            if e.temp and _exists(target / e.temp):
                _remove(target / e.temp)
            elif e.temp and not e.backup:   # installed where nothing was: ours, remove it
                _remove(target / e.final)
            if e.backup and _exists(target / e.backup):
                _retry(os.replace, target / e.backup, target / e.final)
        if config.backup and _exists(target / config.backup):
            _retry(os.replace, target / config.backup, target / CONFIG)
        _retry(_fsync_dir, target)
        _remove(target / config.temp)
    else:
        _retry(_fsync_dir, target)   # the new config.json is durable before any backup goes
        for e in entries:
            for name in (e.temp, e.backup):
                if name:
                    _remove(target / name)
    _retry(_fsync_dir, target)


class _Journal:
    """The record of one save (module docstring): written before anything else, locked while the
    save runs, renamed when the commit begins, removed when the directory is settled."""

    def __init__(self, target: Path, token: str, entries: list[_Entry], fd: int):
        self.target, self.token, self.entries, self.fd = target, token, entries, fd
        self.path = target / _journal_name(token)
        self.committing = False

    @staticmethod
    def head(token: str) -> str:
        return f'{{"{_MAGIC}": 1, "token": "{token}", '

    @classmethod
    def create(cls, target: Path, token: str, entries: list[_Entry]) -> "_Journal":
        path = target / _journal_name(token)
        body = json.dumps({"files": [asdict(e) for e in entries]})
        data = (cls.head(token) + body[1:]).encode()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _lock(fd, path)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
            _fsync_dir(target)
        except BaseException:
            os.close(fd)
            _remove(path)   # torn or not, no temporary exists yet
            raise
        return cls(target, token, entries, fd)

    def begin_commit(self) -> None:
        committed = self.target / _journal_name(self.token, committing=True)
        os.rename(self.path, committed)
        self.path, self.committing = committed, True
        _fsync_dir(self.target)

    def settle(self) -> None:
        """Finish or undo (by the phase and the files), then remove the journal and unlock."""
        _settle(self.target, self.entries, self.committing)
        _remove(self.path)
        try:
            _fsync_dir(self.target)
        except OSError:   # a journal that comes back after a crash is settled again, harmlessly
            pass

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _lock(fd: int, path: Path) -> None:
    if fcntl is None:   # pragma: no cover
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SaveInProgressError(
            f"another save_pretrained is writing into {path.parent} (its journal {path.name} is "
            "locked); wait for it to finish or save into another directory") from None


def _parse_journal(text: str, token: str) -> list[_Entry] | None:
    """The entries of a journal this module wrote with ``token``, or None if it is not one."""
    try:
        d = json.loads(text)
    except ValueError:
        return None
    if not isinstance(d, dict) or d.get(_MAGIC) != 1 or d.get("token") != token:
        return None
    files = d.get("files")
    if not isinstance(files, list):
        return None
    entries, finals = [], set()
    for f in files:
        if not isinstance(f, dict) or set(f) != {"final", "temp", "backup"}:
            return None
        final, temp, backup = f["final"], f["temp"], f["backup"]
        backups = {_backup_name(final, token)} | ({_PREVIOUS_CONFIG} if final == CONFIG else set())
        if (not _final_name(final) or final in finals
                or temp not in (None, _temp_name(final, token))
                or (backup is not None and backup not in backups)):
            return None
        finals.add(final)
        entries.append(_Entry(final, temp, backup))
    if not any(e.final == CONFIG and e.temp for e in entries):
        return None
    return entries


def _torn(text: str, token: str) -> bool:
    """A journal killed while being written: not JSON, and a prefix of what a journal holds."""
    try:
        json.loads(text)
        return False
    except ValueError:
        head = _Journal.head(token)
        return head.startswith(text) or text.startswith(head)


def _settle_interrupted(target: Path) -> None:
    """Settle the journals of saves that were killed (or whose rollback failed) in ``target``."""
    matches = (_STAGING.match(n) or _COMMITTING.match(n) for n in os.listdir(target))
    tokens = sorted({m.group(1) for m in matches if m})
    for token in tokens:
        # The staging name first: a running save renames it to the commit name, never back.
        for name in (_journal_name(token), _journal_name(token, committing=True)):
            try:
                fd = os.open(target / name, os.O_RDONLY)
            except FileNotFoundError:
                continue
            except OSError as e:
                warnings.warn(f"{target / name} looks like the journal of an interrupted save but "
                              f"cannot be read ({e}); it is kept", stacklevel=3)
                break
            try:
                _settle_journal(target, name, token, fd)
            finally:
                os.close(fd)
            break


def _settle_journal(target: Path, name: str, token: str, fd: int) -> None:
    path = target / name
    try:
        _lock(fd, path)
        with open(fd, "rb", closefd=False) as f:
            text = f.read(64 << 20).decode("utf-8", errors="replace")
        entries = _parse_journal(text, token)
        if entries is not None:
            _settle(target, entries, committing=_COMMITTING.match(name) is not None)
            _remove(path)
        elif _STAGING.match(name) and _torn(text, token):
            _remove(path)   # torn while being written: nothing had been created yet
        else:
            warnings.warn(f"{path} has a journal's name but is not a journal AutoXLA wrote; it is "
                          "kept and nothing it names is touched", stacklevel=4)
    except SaveInProgressError:
        raise
    except BaseException as e:
        e.add_note(f"save_pretrained could not settle the interrupted save recorded in {path}; the "
                   "journal is kept with the files it lists: fix the cause and save again")
        raise



def shard_groups(sizes: dict[str, int], limit: int) -> list[list[str]]:
    """Tensor names (in order) grouped into shards of at most ``limit`` bytes (a tensor larger
    than the limit gets a shard of its own); at least one, possibly empty, group."""
    groups, current, size = [], [], 0
    for name, n in sizes.items():
        if current and size + n > limit:
            groups.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    if current or not groups:
        groups.append(current)
    return groups


def write_checkpoint(target: Path, groups: list[list[str]], write_shards, config_text: str,
                     generation_text: str | None) -> None:
    """The journaled, atomic save of one checkpoint into the directory ``target`` (module
    docstring): ``write_shards(paths, groups)`` writes one safetensors file per group of tensor
    names (at the journal's temporary names); the index, generation config and config.json are
    written from the texts given.
    Shared by save_pretrained and the offline quantizer (modeling/offline.py)."""
    _settle_interrupted(target)
    token, names, entries = _plan(target, len(groups), generation_text is not None)
    temp = {e.final: target / e.temp for e in entries if e.temp}
    journal = _Journal.create(target, token, entries)
    try:
        try:
            write_shards([temp[f] for f in names], groups)
            weight_map = {}
            for fname, group in zip(names, groups):
                _fsync_file(temp[fname])
                weight_map.update({n: fname for n in group})
            if len(names) > 1:
                total = sum(_stored_bytes(temp[f]) for f in names)
                index = {"metadata": {"total_size": total}, "weight_map": weight_map}
                _write_text(temp[SAFE_INDEX], json.dumps(index, indent=2, sort_keys=True) + "\n")
            if generation_text is not None:
                _write_text(temp[GENERATION_CONFIG], generation_text)
            _write_text(temp[CONFIG], config_text)
            _fsync_dir(target)

            journal.begin_commit()
            config = next(e for e in entries if e.final == CONFIG)
            for e in [config] + [e for e in entries if e is not config]:
                if e.backup:
                    os.rename(target / e.final, target / e.backup)
            _fsync_dir(target)
            for e in entries:
                if e.temp and e is not config:
                    os.replace(temp[e.final], target / e.final)
            _fsync_dir(target)
            os.replace(temp[CONFIG], target / CONFIG)   # the commit point
        except BaseException as error:
            try:
                journal.settle()
            except BaseException as cleanup:
                error.add_note(
                    f"save_pretrained could not undo the failed save in {target} ({cleanup!r}): "
                    "it holds the previous checkpoint or no config.json; the journal "
                    f"{journal.path.name} is kept and the next save_pretrained into it settles it")
            raise
        try:
            journal.settle()
        except Exception as e:
            warnings.warn(f"the checkpoint in {target} is saved, but removing the previous one's "
                          f"backups failed ({e!r}); the journal {journal.path.name} lists them and "
                          "the next save_pretrained into it removes them", stacklevel=3)
    finally:
        journal.close()


def _stored_bytes(path: Path) -> int:
    """The tensor bytes of a safetensors file: its size less the 8-byte length and the header."""
    with open(path, "rb") as f:
        return os.fstat(f.fileno()).st_size - 8 - int.from_bytes(f.read(8), "little")
