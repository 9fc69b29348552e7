"""Compile the fused-MoE kernels for a CUDA architecture without a GPU (ahead of time, through bundled ptxas).

The interpreter checks what the kernels compute, not whether they compile: a type error in a branch, an op the
interpreter accepts but the compiler rejects, or loads that stop pipelining only show up when Triton lowers the
kernel for a real target. :func:`compile_kernels` runs that lowering (TTIR -> TTGIR -> LLVM -> PTX -> cubin) on any
machine, with the argument specialisations a launch on contiguous tensors gets (16-byte aligned pointers, strides and
dims divisible by 16, unit strides folded to constants), so CPU-only CI catches compile-time regressions.

Lowering needs a process where Triton is *not* in interpreter mode (under ``TRITON_INTERPRET=1`` Triton's own
``@jit`` helpers such as ``tl.cdiv`` are interpreted functions and cannot be compiled), so tests call
:func:`compile_kernels_subprocess`, which runs ``python -m vat.kernels.aot`` with ``TRITON_INTERPRET=0``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from . import fused_moe

_UNIT_STRIDES = ("stride_xk", "stride_wk", "stride_ak", "stride_on", "stride_bn")
_CONSTEXPRS = ("TOP_K", "ACTIVATION", "HAS_BIAS", "IEEE", "BLOCK_M", "BLOCK_N", "BLOCK_K")


@dataclass(frozen=True)
class CompiledInfo:
    """What the lowering produced for one kernel.

    Attributes:
        name: kernel name.
        shared_bytes: static shared memory of the compiled kernel.
        pipelined: the K loop's loads became asynchronous copies (software pipelining happened).
        ptx: the PTX text.
    """

    name: str
    shared_bytes: int
    pipelined: bool
    ptx: str


def _jit(kernel) -> JITFunction:
    # Under TRITON_INTERPRET=1 the module's kernels are InterpretedFunctions; wrap the same Python function again.
    return kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)


def _compile(kernel, pointer_types: dict[str, str], constexprs: dict, arch: int, num_warps: int, num_stages: int):
    fn = _jit(kernel)
    signature, attrs = {}, {}
    constexprs = dict(constexprs)
    for idx, name in enumerate(fn.arg_names):
        if name in _UNIT_STRIDES:
            signature[name] = "constexpr"
            constexprs[name] = 1
        elif name in _CONSTEXPRS:
            signature[name] = "constexpr"
        elif name in pointer_types:
            signature[name] = pointer_types[name]
            attrs[(idx,)] = [["tt.divisibility", 16]]
        elif name in ("alpha", "limit"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name.startswith("stride") or name in ("N", "K"):
                attrs[(idx,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(
        src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=num_warps, num_stages=num_stages)
    )
    return CompiledInfo(
        name=fn.__name__,
        shared_bytes=int(compiled.metadata.shared),
        pipelined="async_copy" in compiled.asm["ttgir"],
        ptx=compiled.asm["ptx"],
    )


def compile_kernels(
    dtype: str = "bf16",
    *,
    arch: int = 90,
    activation: str = "silu",
    has_bias: bool = False,
    top_k: int = 8,
    block_m: int = 16,
    block_n: int = 64,
    block_k: int = 128,
    num_warps: int = 4,
    num_stages: int = 3,
    kernels: tuple[str, ...] = ("gate_up", "down"),
) -> list[CompiledInfo]:
    """Lower the gate_up and/or down kernel for ``sm_{arch}`` with one launch configuration.

    Args:
        dtype: operand dtype as Triton spells it: ``bf16``, ``fp16`` or ``fp32`` (fp32 uses the IEEE dot).
        arch: CUDA compute capability as an int (90 = Hopper, 80 = Ampere).
        activation: ``silu`` or ``gpt_oss_glu``.
        has_bias: compile the bias branches.
        top_k: k (a constexpr of the gate_up kernel).
        block_m: BM.
        block_n: BN.
        block_k: BK.
        num_warps: warps per program.
        num_stages: pipelining stages.
        kernels: which kernels to lower.

    Returns:
        One :class:`CompiledInfo` per kernel.

    Raises:
        triton.compiler.errors.CompilationError: the kernel does not compile.
    """
    if fused_moe.INTERPRETED:
        raise RuntimeError("compile_kernels needs TRITON_INTERPRET unset or 0; use compile_kernels_subprocess")
    common = dict(HAS_BIAS=has_bias, IEEE=dtype == "fp32", BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    operand = f"*{dtype}"
    out = []
    if "gate_up" in kernels:
        pointers = dict(x_ptr=operand, w_ptr=operand, b_ptr=operand, out_ptr=operand)
        pointers.update(sorted_ids_ptr="*i32", block_expert_ptr="*i32")
        meta = dict(common, TOP_K=top_k, ACTIVATION=fused_moe._ACTIVATION_CODE[activation])
        out.append(_compile(fused_moe._gate_up_act_kernel, pointers, meta, arch, num_warps, num_stages))
    if "down" in kernels:
        pointers = dict(a_ptr=operand, w_ptr=operand, b_ptr=operand, topk_w_ptr=operand, out_ptr="*fp32")
        pointers.update(sorted_ids_ptr="*i32", block_expert_ptr="*i32")
        out.append(_compile(fused_moe._down_kernel, pointers, common, arch, num_warps, num_stages))
    return out


def compile_kernels_subprocess(timeout: float = 300.0, **kwargs) -> list[dict]:
    """:func:`compile_kernels` in a fresh ``TRITON_INTERPRET=0`` process; returns the infos as dicts (PTX omitted).

    Raises:
        RuntimeError: the lowering failed (the child's stderr tail is in the message).
    """
    cmd = [sys.executable, "-m", "vat.kernels.aot", "--json", json.dumps(kwargs)]
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"kernel lowering failed ({kwargs}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Lower the fused-MoE kernels for a CUDA arch (no GPU needed).")
    parser.add_argument("--json", default="{}", help="keyword arguments of compile_kernels, as a JSON object")
    args = parser.parse_args(argv)
    kwargs = json.loads(args.json)
    if "kernels" in kwargs:
        kwargs["kernels"] = tuple(kwargs["kernels"])
    infos = compile_kernels(**kwargs)
    print(json.dumps([{k: v for k, v in asdict(info).items() if k != "ptx"} for info in infos]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
