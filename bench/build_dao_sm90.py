"""Restrict causal-conv1d's setup.py (versions 1.6.1 to 1.7.0) to sm_90, so Dao's CUDA kernel, the anchor of
bench.kernels, builds for an H100/H200 alone: about 5 minutes on 16 cores instead of one build per architecture.

    git clone https://github.com/Dao-AILab/causal-conv1d ../causal-conv1d      # the tables used 1.6.1 (0d2252d)
    python -m bench.build_dao_sm90 ../causal-conv1d/setup.py                   # from this repository's root
    cd ../causal-conv1d && CAUSAL_CONV1D_FORCE_BUILD=TRUE MAX_JOBS=12 pip install --no-build-isolation --no-deps .

It replaces the list of `-gencode` flags by `arch=compute_90,code=sm_90`, in place.
"""

import argparse
import re
from pathlib import Path


def restrict_to_sm90(source: str, path: str) -> str:
    first = source.find('cc_flag.append("-gencode")')
    archs = list(re.finditer(r'cc_flag\.append\("arch=compute_\d+a?,code=sm_\d+a?"\)', source))
    if first < 0 or not archs:
        raise SystemExit(f'{path}: no cc_flag.append("-gencode") list found (causal-conv1d 1.6.1 to 1.7.0 have one)')
    return source[:first] + 'cc_flag += ["-gencode", "arch=compute_90,code=sm_90"]' + source[archs[-1].end() :]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("setup_py", help="causal-conv1d's setup.py")
    path = Path(ap.parse_args().setup_py)
    path.write_text(restrict_to_sm90(path.read_text(), str(path)))
    print(f"{path}: builds for sm_90 only")


if __name__ == "__main__":
    main()
