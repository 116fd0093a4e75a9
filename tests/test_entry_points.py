"""One target loader, one device and dtype resolver: no module of the package loads a model or decides "auto" on its
own. A model loaded anywhere but flashdraft/target/load.py would skip its rules (safetensors only, the checkpoint
check, no Hub kernels, no download unless asked, the fast path); an "auto" decided anywhere but flashdraft/devices.py
drifts from the others."""

import ast
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "flashdraft"
LOADER = "flashdraft/target/load.py"
RESOLVER = "flashdraft/devices.py"
DEVICE_WORDS = {"cuda", "cpu"}
DTYPE_WORDS = {"bfloat16", "float32", "bf16", "fp32"}


def _name(node: ast.AST) -> str:
    """`a.b.c` of a Name/Attribute chain ('' for anything else)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}".lstrip(".")
    return ""


def _loads_a_model(node: ast.AST) -> bool:
    """`AutoModel*.from_pretrained(...)` or `*ForCausalLM.from_pretrained(...)`."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return False
    owner = _name(node.func.value).rpartition(".")[2]
    return node.func.attr == "from_pretrained" and (owner.startswith("AutoModel") or owner.endswith("ForCausalLM"))


def _asks_the_machine(node: ast.AST) -> bool:
    """A test about the machine: `torch.cuda.is_available()`, or a comparison with "cuda" (`device.type == "cuda"`)."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call) and _name(sub.func).endswith("cuda.is_available"):
            return True
        if isinstance(sub, ast.Compare) and any(
            isinstance(c, ast.Constant) and c.value == "cuda" for c in (sub.left, *sub.comparators)
        ):
            return True
    return False


def _is_choice(node: ast.AST | None) -> bool:
    """A device or dtype written out: "cuda", "cpu", "bfloat16", torch.float32, torch.device("cuda"), ..."""
    if node is None:
        return False
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and sub.value in DEVICE_WORDS | DTYPE_WORDS:
            return True
        if isinstance(sub, ast.Attribute) and sub.attr in DTYPE_WORDS and _name(sub.value) == "torch":
            return True
    return False


def _chosen(body: list[ast.stmt]) -> bool:
    """Whether a branch assigns or returns a device or dtype written out."""
    return any(isinstance(s, ast.Assign | ast.AnnAssign | ast.Return) and _is_choice(s.value) for s in body)


def _compares_with_auto(node: ast.AST) -> bool:
    return any(
        isinstance(sub, ast.Compare) and any(isinstance(c, ast.Constant) and c.value == "auto" for c in sub.comparators)
        for sub in ast.walk(node)
    )


def _decides_auto(node: ast.AST) -> bool:
    """A device or dtype chosen by what the machine has: `"cuda" if torch.cuda.is_available() else "cpu"`,
    `torch.bfloat16 if device.type == "cuda" else torch.float32`, the same as an if statement, or "auto" resolved
    inline (`device == "auto" and torch.cuda.is_available()`)."""
    if isinstance(node, ast.IfExp):
        return _asks_the_machine(node.test) and (_is_choice(node.body) or _is_choice(node.orelse))
    if isinstance(node, ast.If):
        return _asks_the_machine(node.test) and (_chosen(node.body) or _chosen(node.orelse))
    if isinstance(node, ast.BoolOp):
        return _compares_with_auto(node) and any(
            isinstance(sub, ast.Call) and _name(sub.func).endswith("cuda.is_available") for sub in ast.walk(node)
        )
    return False


def offenders(source: str, where: str) -> list[str]:
    """'where:line: what' for every model load and every "auto" decision in `source` (a module at `where`) that
    belongs to the one loader or the one resolver instead."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if where != LOADER and _loads_a_model(node):
            found.add((node.lineno, "loads a model (use flashdraft.target.load)"))
        if where != RESOLVER and _decides_auto(node):
            found.add((node.lineno, "decides a device or dtype (use flashdraft.devices)"))
    return [f"{where}:{line}: {what}" for line, what in sorted(found)]


def test_no_module_loads_a_model_or_decides_auto_on_its_own():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += offenders(path.read_text(), str(path.relative_to(ROOT)))
    assert found == []


def test_the_scan_finds_planted_offenders():
    planted = textwrap.dedent(
        """
        import torch
        from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

        def load(path, device_name, dtype_name):
            model = AutoModelForCausalLM.from_pretrained(path)
            other = Qwen3ForCausalLM.from_pretrained(path)
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
            named = "bfloat16" if device_name == "cuda" else "float32"
            use_cuda = device_name == "cuda" or device_name == "auto" and torch.cuda.is_available()
            if torch.cuda.is_available():
                where = "cuda"
            else:
                where = "cpu"
            return model, other, device, dtype, named, use_cuda, where
        """
    )
    found = offenders(planted, "flashdraft/cli/planted.py")
    assert [line.split(":")[1] for line in found] == ["6", "7", "8", "9", "10", "11", "12"], found
    # The same lines where they belong: the loader may load, the resolver may decide.
    assert [f for f in offenders(planted, LOADER) if "loads a model" in f] == []
    assert [f for f in offenders(planted, RESOLVER) if "decides" in f] == []


def test_the_scan_leaves_what_decides_nothing_alone():
    innocent = textwrap.dedent(
        """
        import torch

        def run(model, device, graphs=None, dtype=None):
            graphs = device.type == "cuda" if graphs is None else graphs
            state = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
            wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            drafter = DFlashDraftModel.from_pretrained("d")
            tokenizer = AutoTokenizer.from_pretrained("t")
            return graphs, state, wide, drafter, tokenizer
        """
    )
    assert offenders(innocent, "flashdraft/speculative/x.py") == []
