#!/usr/bin/env python3
"""Patch an unpacked Horovod 0.28.1 source distribution for GCC 13 and later (Debian 13's GCC 14),
after scripts/install/patch_horovod.py.

GCC 14 checks member functions of class templates that are never instantiated, and Horovod
0.28.1's bundled FlatBuffers has one that cannot compile:
third_party/flatbuffers/include/flatbuffers/stl_emulation.h's ``span::operator=`` assigns the span's
const members and returns nothing ("assignment of read-only member ... count_"). It can never have
been called, so it is removed (as upstream FlatBuffers did). (The other GCC 13+ failure, standard
headers that libstdc++ no longer includes through others, such as ``<stdexcept>`` in
horovod/common/common.h and ``<string>`` in group_table.h, install.sh meets by pre-including them.)

install.sh runs this only where ``g++`` is version 13 or later, and only there do this file and
those flags enter the Horovod wheel's cache key: older compilers build exactly as before.

Usage: python scripts/install/patch_horovod_gcc13.py SOURCE_DIR (idempotent; exits 1 naming the
file when a text is found neither patched nor unpatched).
"""

from __future__ import annotations

import sys
from pathlib import Path

# As patch_horovod.py's edits: (relative path, original text, replacement text, text present only
# once patched or None, text absent once patched). Each original occurs exactly once in its file.
EDITS = [
    (
        "third_party/flatbuffers/include/flatbuffers/stl_emulation.h",
        "  FLATBUFFERS_CONSTEXPR_CPP14 span &operator=(const span &other)\n"
        "      FLATBUFFERS_NOEXCEPT {\n"
        "    data_ = other.data_;\n"
        "    count_ = other.count_;\n"
        "  }\n",
        "",
        "FLATBUFFERS_CONSTEXPR_CPP11 span(const span &other)",
        "span &operator=(const span &other)",
    ),
]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: patch_horovod_gcc13.py SOURCE_DIR", file=sys.stderr)
        return 2
    for rel, old, new, present, absent in EDITS:
        path = Path(argv[1]) / rel
        text = path.read_text() if path.is_file() else ""
        if text.count(old) == 1:
            path.write_text(text.replace(old, new))
            print(f"patch_horovod_gcc13: patched {rel}")
        elif present in text and absent not in text:
            print(f"patch_horovod_gcc13: {rel} already patched")
        else:
            print(f"patch_horovod_gcc13: {rel}: neither the original nor the patched text (horovod 0.28.1?)")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
