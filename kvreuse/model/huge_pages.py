"""Transparent huge pages: whether Linux backs memory with them, and the `kvreuse` command's heap in them.

Linux's default THP setting, "madvise", backs with 2 MB pages only memory advised MADV_HUGEPAGE; everything else
(torch's tensors come from glibc's malloc) sits in 4 KB pages, each of which costs its first touch a page walk and
stops the prefetchers at its end. On the 2-core VM of docs/RESULTS.md ("The heap in huge pages"), a reuse
prefill's placing of stored KV (about 70 MB read and 70 MB written) took 7-9 ms with the heap in huge pages and 15-29
ms without, and 64 MB untouched for a second read 7x slower in 4 KB pages than in huge ones.

glibc (2.35 on) advises its own heap and mappings when told to by its tunable `glibc.malloc.hugetlb=1`, which it
reads only as a process starts: the `kvreuse` command therefore starts itself again once, with the tunable set
(`exec_with_huge_page_heap`), unless THP is "always" (nothing to advise) or "never", or the tunable was chosen by
whoever started it (`GLIBC_TUNABLES=glibc.malloc.hugetlb=0` keeps 4 KB pages). A program that embeds the engine
sets the tunable itself. This module imports nothing heavy: it runs before the command imports torch.
"""

from __future__ import annotations

import functools
import logging
import mmap
import os
import sys
from collections.abc import Mapping
from pathlib import Path

HUGE_PAGE = 2 << 20
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
TUNABLES = "GLIBC_TUNABLES"
HEAP_TUNABLE = "glibc.malloc.hugetlb"
FIRST_GLIBC_WITH_IT = (2, 35)

log = logging.getLogger(__name__)


@functools.cache
def thp_setting() -> str | None:
    """Linux's THP setting ("always", "madvise" or "never"), None where it cannot be read (not Linux)."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")] if "[" in text and "]" in text else None


@functools.cache
def huge_pages_advisable() -> bool:
    """Whether Linux backs memory advised MADV_HUGEPAGE with transparent huge pages: THP set to "always" or
    "madvise" (not "never"), and Python's mmap able to advise it."""
    return hasattr(mmap, "MADV_HUGEPAGE") and thp_setting() in ("always", "madvise")


def glibc_version() -> tuple[int, ...] | None:
    """The running C library's version if it is glibc (os.confstr's "glibc 2.36"), else None."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
        return tuple(int(part) for part in version.split(".")) if name == "glibc" else None
    except (AttributeError, ValueError, OSError):
        return None


def heap_environment(environ: Mapping[str, str], thp: str | None, glibc: tuple[int, ...] | None
                     ) -> dict[str, str] | None:
    """`environ` with glibc's malloc told to advise its memory for THP, where that changes anything: THP waiting for
    advice ("madvise"), a glibc that reads the tunable, and the tunable not chosen already. Else None."""
    tunables = environ.get(TUNABLES, "")
    chosen = any(setting.split("=")[0] == HEAP_TUNABLE for setting in tunables.split(":"))
    if thp != "madvise" or glibc is None or glibc < FIRST_GLIBC_WITH_IT or chosen:
        return None
    return {**environ, TUNABLES: ":".join(filter(None, [tunables, f"{HEAP_TUNABLE}=1"]))}


def exec_with_huge_page_heap() -> None:
    """Start the running command again (same interpreter, arguments and pid) with its heap advised for THP, if
    `heap_environment` says that changes anything; return (doing nothing) otherwise."""
    environ = heap_environment(os.environ, thp_setting(), glibc_version())
    if environ is None or not sys.executable:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, sys.orig_argv, environ)
    except OSError as error:  # the command runs on as it was started
        log.warning("could not restart with the heap in huge pages (%s): running in 4 KB pages", error)
