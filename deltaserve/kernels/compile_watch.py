"""Triton's compiles counted, so that a step slowed by one shows in the log.

Triton builds a kernel once per process for each variant it meets (its constexprs, and each way an integer argument
falls: 1, a multiple of 16, neither) and keeps the binary in ~/.triton/cache: a variant this machine never built
compiles for seconds inside the step that meets it, one built before loads from disk in milliseconds. Nothing else
shows either. record() installs a listener on Triton's compiler (triton.knobs.compilation.listener, Triton 3.4 and
later; a listener already there still runs) that counts every compile and disk load with its time; CompileWatch reads
the counts every few steps and logs what happened since it last looked."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from deltaserve.kernels.step_watch import StepWatch

log = logging.getLogger("deltaserve")


@dataclass
class CompileCounts:
    """Compiles and disk loads since the process installed the listener: how many, their microseconds, the kernels
    compiled (by name, with their count) and each compiled variant's specialisation (variant_of's, in order)."""

    compiled: int = 0
    compiled_us: int = 0
    loaded: int = 0
    loaded_us: int = 0
    kernels: dict[str, int] = field(default_factory=dict)
    variants: list[str] = field(default_factory=list)

    def add(self, name: str, cache_hit: bool, us: int, variant: str = "") -> None:
        if cache_hit:
            self.loaded, self.loaded_us = self.loaded + 1, self.loaded_us + us
        else:
            self.compiled, self.compiled_us = self.compiled + 1, self.compiled_us + us
            self.kernels[name] = self.kernels.get(name, 0) + 1
            self.variants.append(f"{name}({variant})")

    def since(self, before: CompileCounts) -> CompileCounts:
        kernels = {k: n - before.kernels.get(k, 0) for k, n in self.kernels.items() if n > before.kernels.get(k, 0)}
        return CompileCounts(self.compiled - before.compiled, self.compiled_us - before.compiled_us,
                             self.loaded - before.loaded, self.loaded_us - before.loaded_us, kernels,
                             self.variants[len(before.variants):])

    def copy(self) -> CompileCounts:
        return self.since(CompileCounts())

    def describe(self) -> str:
        text = (f"Triton compiled {self.compiled} kernel variant(s) ({self.compiled_us / 1e6:.2f} s) and loaded "
                f"{self.loaded} from its disk cache ({self.loaded_us / 1e6:.2f} s)")
        if self.kernels:
            text += ": " + ", ".join(f"{name} ({n})" for name, n in sorted(self.kernels.items()))
        return text


def variant_of(src) -> str:
    """What a compile's source (Triton's ASTSource) was specialised on: its constants (the constexprs, and integer
    arguments equal to 1) as name=value and the arguments taken as multiples of 16 (integers; pointers, 16-byte
    aligned) as name%16, so two variants of one kernel show where they differ. Empty where the source has none,
    "?" where a Triton release keeps them otherwise."""
    try:
        return _specialisation(src)
    except Exception:  # a description lost, never a count
        return "?"


def _specialisation(src) -> str:
    names = list(getattr(src, "signature", None) or {})

    def name(key) -> str:
        index = key[0] if isinstance(key, tuple) and len(key) == 1 else key
        return names[index] if isinstance(index, int) and 0 <= index < len(names) else str(key)

    parts = [f"{name(k)}={v}" for k, v in (getattr(src, "constants", None) or {}).items()]
    parts += [f"{name(k)}%16" for k, attrs in (getattr(src, "attrs", None) or {}).items()
              if any(a and a[0] == "tt.divisibility" for a in attrs)]
    return ", ".join(parts)


COUNTS = CompileCounts()  # the process's, filled by the listener record() installs
_installed = False


def record() -> bool:
    """Install the counting listener on Triton's compiler (once a process); False where this Triton has none."""
    global _installed
    if _installed:
        return True
    try:
        from triton import knobs
    except ImportError:
        return False
    compilation = getattr(knobs, "compilation", None)
    if compilation is None or not hasattr(compilation, "listener"):
        return False
    before = compilation.listener

    def listener(**event):  # inside every compile: it never raises, whatever a Triton release passes
        try:
            metadata = event.get("metadata") or {}
            name = getattr(event.get("src"), "name", None) or str(metadata.get("name", "?"))
            COUNTS.add(name, bool(event.get("cache_hit")), int(getattr(event.get("times"), "total", 0)),
                       variant_of(event.get("src")))
        except Exception as e:  # a count lost, never a compile
            log.debug("not counting a Triton compile: %s", e)
        if before is not None:
            before(**event)

    compilation.listener = listener
    _installed = True
    return True


class CompileWatch(StepWatch):
    """Every `every` steps, logs the compiles and disk loads since the last look, if any (counts: COUNTS or a
    stand-in)."""

    def __init__(self, every: int = 64, counts: CompileCounts | None = None):
        self.counts = counts if counts is not None else COUNTS
        super().__init__(every)

    def _snapshot(self) -> CompileCounts:
        return self.counts.copy()

    def check(self) -> CompileCounts:
        """The compiles and loads since the last look, logged when there are any."""
        new = self.counts.since(self._seen)
        (first, last), self._seen = self._window(), self.counts.copy()
        if new.compiled or new.loaded:
            log.info("steps %d-%d waited while %s", first, last, new.describe())
        return new
