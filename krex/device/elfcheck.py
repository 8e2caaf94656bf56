"""Detect binaries that link the CUDA runtime statically (DESIGN.md consequence 5):
they define __cudaRegisterFatBinary and have no libcudart in DT_NEEDED. Their
launches go through the driver's private export table, which no symbol hook
sees; freezing still protects against them, gating cannot."""

from __future__ import annotations

import struct
from dataclasses import dataclass


@dataclass
class ElfInfo:
    is_elf: bool
    needed: list[str]
    defines_fatbin_register: bool

    @property
    def static_cudart(self) -> bool:
        return self.defines_fatbin_register and not any("libcudart" in n for n in self.needed)


def inspect(path: str) -> ElfInfo:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return ElfInfo(False, [], False)
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:  # 64-bit little-endian only
        return ElfInfo(False, [], False)
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    secs = []
    for i in range(shnum):
        name, typ, _fl, _addr, off, size, link, _info, _al, entsize = struct.unpack_from(
            "<IIQQQQIIQQ", data, shoff + i * shentsize
        )
        secs.append((name, typ, off, size, link, entsize))

    def cstr(off: int) -> str:
        end = data.index(b"\0", off)
        return data[off:end].decode(errors="replace")

    needed: list[str] = []
    defines = False
    for _name, typ, off, size, link, entsize in secs:
        if typ == 6:  # SHT_DYNAMIC
            stroff = secs[link][2]
            for j in range(0, size, 16):
                tag, val = struct.unpack_from("<qQ", data, off + j)
                if tag == 1:  # DT_NEEDED
                    needed.append(cstr(stroff + val))
        elif typ in (2, 11) and entsize:  # SHT_SYMTAB, SHT_DYNSYM
            stroff = secs[link][2]
            for j in range(0, size, entsize):
                st_name, _info, _other, shndx = struct.unpack_from("<IBBH", data, off + j)
                if shndx != 0 and st_name and cstr(stroff + st_name) == "__cudaRegisterFatBinary":
                    defines = True
    return ElfInfo(True, needed, defines)
