"""Triton autotuning decisions kept on disk, so that a machine tunes each kernel and shape once.

triton.autotune times every candidate the first time a kernel meets a new key, in every process. Each autotuner
keeps its choices in `.cache` ({key tuple: triton.Config}); this module writes them to one JSON file per GPU name
and Triton version (under ~/.cache/deltaserve/autotune) and restores them into a new process's autotuners. An
entry records the chosen candidate's index and a hash of the candidate list, so changed candidates tune again.
The package ships such files for the cards we measure (tuning_tables/, the same names): a new machine with one of
them starts from those decisions, and what it tunes itself is kept in its own file, which wins.
Works on anything with `.configs` (a list) and `.cache` (a dict); find_autotuners() finds triton's."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
import tempfile
import weakref
from pathlib import Path

from deltaserve.kernels.step_watch import StepWatch

log = logging.getLogger("deltaserve")

TUNED_MODULES = ("deltaserve.kernels", "fla.")  # whose module-level autotuners are kept


SHIPPED_TABLES = Path(__file__).parent / "tuning_tables"
FLA_MODULE = "deltaserve.kernels.kda.fla_chunk"  # imports fla-core; restores its tuning itself when first imported


def decisions_path(gpu_name: str, triton_version: str, base: Path | None = None) -> Path:
    """<base>/<gpu>-triton-<version>.json; base defaults to ~/.cache/deltaserve/autotune ($XDG_CACHE_HOME instead
    of ~/.cache if set)."""
    if base is None:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "deltaserve" / "autotune"
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{gpu_name}-triton-{triton_version}")
    return base / f"{safe}.json"


def find_autotuners(prefixes: tuple[str, ...] = TUNED_MODULES) -> dict[str, object]:
    """The triton Autotuners defined at module level in the loaded modules under prefixes (through heuristics and
    other wrappers, which hold the kernel as .fn), by "module.name"."""
    from triton.runtime.autotuner import Autotuner

    found = {}
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith(prefixes):
            continue
        for attr, value in list(vars(module).items()):
            for _ in range(4):  # a wrapper's .fn, a few deep
                if isinstance(value, Autotuner):
                    found[f"{module_name}.{attr}"] = value
                    break
                value = getattr(value, "fn", None)
    return found


# tuner -> how many decisions load_decisions put into it that it did not hold: what TuningWatch does not count as
# tuned in this process (one tuner may be found under two module names; it is one key here)
_RESTORED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def load_decisions(path: Path, tuners: dict[str, object]) -> int:
    """Put the decisions stored at path into tuners whose candidates are unchanged (a key a tuner holds keeps its
    decision); returns how many were put in."""
    stored = _read(path)
    restored = 0
    for name, tuner in tuners.items():
        entry = stored.get(name)
        if entry is not None and not _well_formed(entry):  # damaged: that kernel tunes again
            log.warning("ignoring the stored autotuning decisions of %s in %s (not as written)", name, path)
            continue
        if entry is None or entry["candidates"] != _candidates_hash(tuner):
            continue
        for key, index in entry["chosen"]:
            key = _as_tuple(key)
            if 0 <= index < len(tuner.configs) and key not in tuner.cache:
                tuner.cache[key] = tuner.configs[index]
                _RESTORED[tuner] = _RESTORED.get(tuner, 0) + 1
                restored += 1
    return restored


def save_decisions(path: Path, tuners: dict[str, object]) -> int:
    """Add the tuners' decisions to the file at path (written whole, then renamed); returns how many it holds."""
    stored = _read(path)
    for name, tuner in tuners.items():
        chosen = [[list(key), _index(tuner, config)] for key, config in tuner.cache.items() if _storable(key)]
        chosen = [pair for pair in chosen if pair[1] is not None]
        entry = stored.get(name)
        if _well_formed(entry) and entry["candidates"] == _candidates_hash(tuner):  # keep what others tuned
            known = {json.dumps(key) for key, _ in chosen}
            chosen += [pair for pair in entry["chosen"] if json.dumps(pair[0]) not in known]
        if chosen:
            stored[name] = {"candidates": _candidates_hash(tuner), "chosen": chosen}
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".partial", delete=False) as f:
        json.dump(stored, f, indent=0, sort_keys=True)
    os.replace(f.name, path)
    return sum(len(entry["chosen"]) for entry in stored.values() if _well_formed(entry))


def _well_formed(entry) -> bool:
    """An entry as save_decisions writes it: {"candidates": hash, "chosen": [[key list, index], ...]}."""
    return (isinstance(entry, dict) and isinstance(entry.get("candidates"), str)
            and isinstance(entry.get("chosen"), list)
            and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], list) and isinstance(p[1], int)
                    for p in entry["chosen"]))


def _read(path: Path) -> dict:
    try:
        stored = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:  # a damaged file costs a new tuning, never a failed start
        log.warning("ignoring the autotuning decisions in %s (%s); kernels tune again", path, e)
        return {}
    return stored if isinstance(stored, dict) else {}


def _candidates_hash(tuner) -> str:
    return hashlib.sha256("|".join(str(config) for config in tuner.configs).encode()).hexdigest()[:16]


def _index(tuner, config) -> int | None:
    for i, candidate in enumerate(tuner.configs):
        if candidate is config or str(candidate) == str(config):
            return i
    return None


def _storable(key) -> bool:
    try:
        return isinstance(key, tuple) and _as_tuple(json.loads(json.dumps(list(key)))) == key
    except (TypeError, ValueError):
        return False


def _as_tuple(value):
    return tuple(_as_tuple(v) for v in value) if isinstance(value, list) else value


def restore_tuning(device) -> Path:
    """On a GPU: import our kernel modules that tune, put this GPU's and Triton's stored decisions into them, and
    have the decisions saved again at exit (with those tuned meanwhile, fla-core's too where a long prefill imported
    it: restore_imported_tuning). Returns the file."""
    import atexit

    import torch
    import triton

    from deltaserve.kernels import compile_watch

    compile_watch.record()  # from here on the process counts Triton's compiles (the engine's CompileWatch reads them)
    _import_tuned_kernels()
    path = restore_decisions(torch.cuda.get_device_name(device), triton.__version__, find_autotuners())
    atexit.register(persist_tuning, path)
    return path


def restore_imported_tuning(prefixes: tuple[str, ...]) -> None:
    """The stored decisions put into the autotuners of modules imported after the start (fla-core's: its imports
    take seconds, so only the first prefill that runs its kernels imports it); saved at exit by restore_tuning's
    hook like the others."""
    import torch
    import triton

    if torch.cuda.is_available():  # decisions are per GPU; an import without one has none to restore
        restore_decisions(torch.cuda.get_device_name(), triton.__version__, find_autotuners(prefixes))


def restore_decisions(gpu_name: str, triton_version: str, tuners: dict[str, object],
                      shipped_dir: Path = SHIPPED_TABLES) -> Path:
    """Put this machine's stored decisions, then the shipped table's for keys still open, into tuners; returns the
    machine's file (where decisions are saved)."""
    path = decisions_path(gpu_name, triton_version)
    own = load_decisions(path, tuners)  # first: a key both hold keeps this machine's own decision
    shipped = load_decisions(decisions_path(gpu_name, triton_version, shipped_dir), tuners)
    log.info("autotuning: %d stored decisions from %s, %d more shipped with deltaserve", own, path, shipped)
    return path


def persist_tuning(path: Path) -> None:
    """Save every loaded autotuner's decisions to path; a failure is a warning (the next start tunes again)."""
    try:
        save_decisions(path, find_autotuners())
    except OSError as e:
        log.warning("could not save the autotuning decisions to %s (%s)", path, e)


class TuningWatch(StepWatch):
    """Kernels that tune while the engine serves. A kernel meeting a key its autotuner holds no decision for (a new
    shape: a prefill chunk of a new length bucket, a kernel first imported by a long prefill) compiles and times every
    candidate inside the step that met it, so that step takes seconds; nothing else shows it. Every `every` steps
    the watch counts the decisions its tuners hold beyond those restored from disk; when there are new ones it logs
    which kernels tuned (or took a decision from Triton's own cache) and saves them to the machine's file at once
    (not only at exit), so that a process started meanwhile (serve's engine process, a benchmark's next run) or
    after a kill does not tune them again."""

    def __init__(self, path: Path, every: int = 64, find=None, save=None):
        self.path = path
        self._find = find or find_autotuners
        self._save = save or save_decisions
        super().__init__(every)  # what start-up tuned (warm-up, graph capture) is saved by the runner

    def _snapshot(self) -> dict[str, int]:
        return self._tuned()

    def check(self) -> int:
        """Log and save the decisions made since the last look; returns how many."""
        tuners = self._find()
        now = self._tuned(tuners)
        grew = {name: count - self._seen.get(name, 0) for name, count in now.items() if count > self._seen.get(name, 0)}
        (first, last), self._seen = self._window(), now
        if not grew:
            return 0
        new = sum(grew.values())
        kernels = ", ".join(f"{name} ({count})" for name, count in sorted(grew.items()))
        log.info("autotuning: %d new decision(s) in steps %d-%d (a new key times its candidates inside the step "
                 "that meets it, unless Triton's own cache holds it): %s; saved to %s", new, first, last, kernels,
                 self.path)
        try:
            self._save(self.path, tuners)
        except OSError as e:
            log.warning("could not save the autotuning decisions to %s (%s)", self.path, e)
        return new

    def _tuned(self, tuners: dict[str, object] | None = None) -> dict[str, int]:
        """{name: decisions beyond those restored}, one name per tuner (a tuner found under two module names counts
        once, under the first name in order)."""
        counts, seen = {}, set()
        for name, tuner in sorted((tuners if tuners is not None else self._find()).items()):
            if id(tuner) not in seen:
                seen.add(id(tuner))
                counts[name] = len(tuner.cache) - _RESTORED.get(tuner, 0)
        return counts


def _import_tuned_kernels() -> None:
    """Import our kernel modules, all but kernels.kda.fla_chunk (it imports fla-core)."""
    import importlib
    import pkgutil

    import deltaserve.kernels

    for info in pkgutil.walk_packages(deltaserve.kernels.__path__, "deltaserve.kernels."):
        if info.name == FLA_MODULE:
            continue
        try:
            importlib.import_module(info.name)
        except Exception as e:  # a module that cannot load never runs: no failed start
            log.debug("not restoring the tuning of %s: %s", info.name, e)
