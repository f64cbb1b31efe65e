#!/usr/bin/env python3
"""Compiles every ```cpp block of README.md and docs/*.md against the real headers.

A block with its own main() is compiled exactly as it is. Any other block goes inside a
function that first declares what the docs take as given (tests/docs/doc_context.hpp: pg, dp,
engine, ...), with its #include lines moved to the top. Nothing hides a missing include: a block
with #include lines compiles with those alone (the context declares ddp's classes without
defining them, and `dp` only when the block includes the wrapper); a block without any is a
fragment of a program that includes <ddp/ddp.hpp>, and gets just that. Blocks that include an
optional SDK's header (MPI, NCCL/CUDA, libsodium, oneTBB, LibTorch, Eigen) are compiled when that SDK's headers are found,
else reported as skipped.

Then every name `ddp::NAME` that README.md mentions, in blocks or in running text, must be
offered by <ddp/ddp.hpp> alone (optional-SDK names excepted), and every type README.md writes
in running text (`ddp::basic_data_parallel<...>`) must be a complete type with it.

  check_snippets.py SOURCE_ROOT COMPILER [ARGS...]
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

root, compiler = sys.argv[1], sys.argv[2:]


def sdk_flags():
    flags = {}
    mpicxx = shutil.which("mpicxx")
    if mpicxx:
        out = subprocess.run([mpicxx, "--showme:compile"], capture_output=True, text=True)
        if out.returncode == 0:
            flags["mpi"] = out.stdout.split()
    cuda = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    if os.path.exists(os.path.join(cuda, "include", "cuda_runtime.h")):
        flags["cuda"] = ["-I" + os.path.join(cuda, "include")]
    if os.path.exists("/usr/include/sodium.h"):
        flags["sodium"] = []
    if os.path.exists("/usr/include/oneapi/tbb/parallel_for.h"):
        flags["tbb"] = []
    torch_api = "/usr/include/torch/csrc/api/include"
    if os.path.exists(os.path.join(torch_api, "torch", "torch.h")):
        flags["torch"] = ["-isystem", torch_api]
    if os.path.exists("/usr/include/eigen3/Eigen/Core"):
        flags["eigen"] = ["-isystem", "/usr/include/eigen3"]
    return flags


def needs(block):
    out = set()
    if re.search(r"ddp/reducer/mpi\.hpp|<mpi\.h>", block):
        out.add("mpi")
    if re.search(r"ddp/reducer/nccl\.hpp|cuda_allocator|pinned_allocator|<cuda", block):
        out.add("cuda")
    if "ddp/auth/sodium.hpp" in block:
        out.add("sodium")
    if "ddp/parallel/tbb.hpp" in block:
        out.add("tbb")
    if re.search(r"ddp/adapters/libtorch\.hpp|<torch/", block):
        out.add("torch")
    if re.search(r"ddp/adapters/eigen\.hpp|<Eigen/", block):
        out.add("eigen")
    return out


def blocks(path):
    text = open(path, encoding="utf-8").read()
    for m in re.finditer(r"^```(?:cpp|c\+\+)\n(.*?)^```", text, re.S | re.M):
        yield text.count("\n", 0, m.start()) + 2, m.group(1)


def unit(block):
    if re.search(r"^\s*int\s+main\s*\(", block, re.M):
        return block
    includes = [l for l in block.splitlines() if l.startswith("#include")]
    body = [l for l in block.splitlines() if not l.startswith("#include")]
    context = []
    if not includes:
        context += ["#define DDP_DOC_UMBRELLA", "#define DDP_DOC_WRAPPER"]
    elif any(re.search(r"<ddp/(ddp|data_parallel)\.hpp>", l) for l in includes):
        context += ["#define DDP_DOC_WRAPPER"]
    return ("\n".join(includes + context) + '\n#include "doc_context.hpp"\n'
            "int doc_snippet([[maybe_unused]] int argc, [[maybe_unused]] char** argv) {\n"
            "  DDP_DOC_CONTEXT\n  {\n" + "\n".join(body) + "\n  }\n  return 0;\n}\n")


flags = sdk_flags()
files = [os.path.join(root, "README.md")] + sorted(
    os.path.join(root, "docs", f) for f in os.listdir(os.path.join(root, "docs")) if f.endswith(".md"))
passed = failed = skipped = 0
with tempfile.TemporaryDirectory() as tmp:
    for path in files:
        for line, block in blocks(path):
            where = f"{os.path.relpath(path, root)}:{line}"
            extra = []
            missing = [s for s in sorted(needs(block)) if s not in flags]
            if missing:
                print(f"SKIP {where}: no {', '.join(missing)} headers here")
                skipped += 1
                continue
            for s in needs(block):
                extra += flags[s]
            src = os.path.join(tmp, "snippet.cpp")
            open(src, "w").write(unit(block))
            cmd = compiler + ["-std=c++20", "-fsyntax-only", "-Wall", "-Wextra",
                              "-I" + os.path.join(root, "include"), "-I" + os.path.join(root, "tests", "docs")] + extra + [src]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode == 0:
                passed += 1
            else:
                failed += 1
                print(f"FAIL {where}: this code block does not compile:\n{block}\n{res.stderr}")
print(f"doc snippets: {passed} compile, {failed} fail, {skipped} skipped")

# What README.md names must come with <ddp/ddp.hpp> alone. The optional parts have their own
# headers (README says which), so they are not expected from the umbrella.
OPTIONAL = {"nccl_reducer", "mpi_reducer", "cuda_allocator", "pinned_allocator", "sodium_authenticator",
            "use_tbb", "set_kernel_threads", "detail", "torch_parameters", "torch_data_parallel",
            "eigen_parameters",
            "ddp"}  # the CMake target ddp::ddp
readme = open(os.path.join(root, "README.md"), encoding="utf-8").read()
names = sorted(set(re.findall(r"\bddp::(\w+)", readme)) - OPTIONAL)
types = sorted({t for t in re.findall(r"`(ddp::[\w:<>, ]+)`", readme) if "<" in t})
probe = ["#include <ddp/ddp.hpp>", "namespace readme_names {"] + [f"using ddp::{n};" for n in names] + ["}"]
probe += [f"static_assert(sizeof({t}) > 0);" for t in types]
src = os.path.join(tempfile.gettempdir(), f"readme_names_{os.getpid()}.cpp")
open(src, "w").write("\n".join(probe) + "\n")
res = subprocess.run(compiler + ["-std=c++20", "-fsyntax-only", "-I" + os.path.join(root, "include"), src],
                     capture_output=True, text=True)
os.unlink(src)
if res.returncode == 0:
    print(f"README names: <ddp/ddp.hpp> offers all {len(names)} (ddp::{', ddp::'.join(names)}) "
          f"and {len(types)} written types")
else:
    failed += 1
    print("FAIL README.md names what <ddp/ddp.hpp> alone does not offer:\n" + res.stderr)
sys.exit(1 if failed else 0)
