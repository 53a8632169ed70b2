"""Every patch gdn_export applies to third-party internals (torch-to-nnef, torch), in one place.

A patch replaces one attribute of a third-party object (a function of a module, a method of a class, an entry of a
registry dict) for the duration of a ``with patched(...)`` block, never for the process: the first block to enter
installs it, the last to leave restores the original (blocks of several threads share one installation; a patch
whose replacement holds per-call state is ``exclusive``: one block at a time). Each patch module asserts the
installed version it was written for (``require``) and names its ``Quirk`` in ``gdn_export.tract_quirks``; each
patched original has a canary in tests/test_compat.py that fails the day upstream changes it.

torch_to_nnef.py: torch-to-nnef's node order and names, its shape inference, its handler registry, its tract
download, its compile at import, and the write / neutral-op / clone hooks of streamed weights.
torch_onnx.py: torch's TorchScript ONNX passes (constant folding and initializer deduplication) observed by the
streamed ONNX writer.

Compat sits at the bottom of the package (it imports nothing of gdn_export but ``errors``), so that any layer
may apply a patch; what a patch does for gdn_export lives with the code that needs it, which hands compat the
replacement.
"""

from __future__ import annotations

import importlib.metadata
import threading
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from gdn_export.errors import GdnExportError

# distribution -> the version its patches were written for (a prefix: "2.13" accepts 2.13.x)
WRITTEN_FOR = {"torch_to_nnef": "0.24.12", "torch": "2.13"}


class CompatError(GdnExportError):
    """An installed library is not the version gdn_export's patches of its internals were written for."""


def require(distribution: str) -> str:
    """The installed version of ``distribution``; CompatError unless it is the one its patches were written for."""
    expected = WRITTEN_FOR[distribution]
    try:
        found = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise CompatError(f"{distribution} is not installed; gdn_export needs {distribution} {expected} "
                          "(pip install 'gdn-export[convert]')") from None
    release = found.split("+")[0]
    if release != expected and not release.startswith(expected + "."):
        raise CompatError(f"{distribution} {found} is installed; gdn_export patches its internals as of {expected} "
                          f"and was not checked with another version (pip install '{distribution}=={expected}"
                          f"{'.*' if expected.count('.') == 1 else ''}')")
    return found


_MISSING = object()


@dataclass(frozen=True)
class Patch:
    """``owner.attribute`` (or ``owner[attribute]`` for a dict) replaced by ``make(original)`` while patched.

    ``quirk``: the name of the ``tract_quirks`` record it works around; ``exclusive``: the replacement holds the
    state of one call, so blocks applying it run one at a time."""

    owner: Any
    attribute: str
    make: Callable[[Any], Any]
    quirk: str
    exclusive: bool = False

    def get(self) -> Any:
        """What restoring puts back: the owner's own entry (_MISSING where a class inherits the attribute)."""
        if isinstance(self.owner, dict):
            return self.owner.get(self.attribute, _MISSING)
        return self.owner.__dict__.get(self.attribute, _MISSING) if isinstance(self.owner, type) else getattr(
            self.owner, self.attribute, _MISSING)

    def current(self) -> Any:
        """What the replacement wraps: the value seen through the owner (inherited ones too)."""
        if isinstance(self.owner, dict):
            return self.owner.get(self.attribute)
        return getattr(self.owner, self.attribute, None)

    def set(self, value: Any) -> None:
        if isinstance(self.owner, dict):
            if value is _MISSING:
                self.owner.pop(self.attribute, None)
            else:
                self.owner[self.attribute] = value
        elif value is _MISSING:
            delattr(self.owner, self.attribute)
        else:
            setattr(self.owner, self.attribute, value)

    @property
    def key(self) -> tuple[int, str]:
        return id(self.owner), self.attribute


_LOCK = threading.RLock()
_INSTALLED: dict[tuple[int, str], list] = {}  # key -> [blocks inside, original]
_EXCLUSIVE: dict[tuple[int, str], threading.RLock] = {}


def _original_of(patch: Patch) -> Any:
    """The value a patch replaced (the current one where it is not installed)."""
    with _LOCK:
        installed = _INSTALLED.get(patch.key)
        return installed[1] if installed else patch.get()


@contextmanager
def _one(patch: Patch) -> Iterator[None]:
    with ExitStack() as stack:
        if patch.exclusive:
            with _LOCK:
                lock = _EXCLUSIVE.setdefault(patch.key, threading.RLock())
            stack.enter_context(lock)
        with _LOCK:
            installed = _INSTALLED.get(patch.key)
            if installed is None:
                original = patch.get()
                patch.set(patch.make(patch.current()))
                _INSTALLED[patch.key] = [1, original]
            else:
                installed[0] += 1
        try:
            yield
        finally:
            with _LOCK:
                installed = _INSTALLED[patch.key]
                installed[0] -= 1
                if installed[0] == 0:
                    patch.set(installed[1])
                    del _INSTALLED[patch.key]


@contextmanager
def patched(*patches: Patch) -> Iterator[None]:
    """Apply ``patches`` for the duration of the block (restored on exit, whatever happens inside)."""
    with ExitStack() as stack:
        for patch in patches:
            stack.enter_context(_one(patch))
        yield


def installed_patches() -> list[str]:
    """``owner.attribute`` of every patch installed now (none outside a conversion)."""
    with _LOCK:
        return sorted(f"{key[1]}" for key in _INSTALLED)
