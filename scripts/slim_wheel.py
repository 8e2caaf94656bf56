"""Rewrite a Ray wheel without what `krex fleet` never loads, so it fits a size limit.

    python3 scripts/slim_wheel.py IN.whl OUT_DIR

Dropped: ray/jars (the Java worker, a third of the wheel) and the dashboard's
JavaScript source maps. The Python workers, raylet, GCS and the Python libraries stay.
RECORD loses the dropped files' lines, so the rest still verifies. The file name is
kept (pip reads the tags from it)."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

DROP = ("ray/jars/",)
DROP_SUFFIX = (".js.map",)


def dropped(name: str) -> bool:
    return name.startswith(DROP) or name.endswith(DROP_SUFFIX)


def slim(src: Path, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    dst = out_dir / src.name
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for info in zin.infolist():
            if dropped(info.filename):
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(ln for ln in lines if not dropped(ln.split(",", 1)[0])).encode()
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    return dst


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    src = Path(sys.argv[1])
    dst = slim(src, Path(sys.argv[2]))
    print(f"{src.name}: {src.stat().st_size / 2**20:.1f} MiB -> {dst.stat().st_size / 2**20:.1f} MiB")
