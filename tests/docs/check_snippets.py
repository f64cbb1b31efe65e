#!/usr/bin/env python3
"""Compiles every ```cpp block of README.md and docs/*.md against the real headers.

A block with its own main() is compiled as it is; any other block goes inside a function that
first declares what the docs take as given (tests/docs/doc_context.hpp: pg, dp, engine, ...),
with its #include lines moved to the top. Blocks that include an optional SDK's header (MPI,
NCCL/CUDA, libsodium) are compiled when that SDK's headers are found, else reported as skipped.

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
    return flags


def needs(block):
    out = set()
    if re.search(r"ddp/reducer/mpi\.hpp|<mpi\.h>", block):
        out.add("mpi")
    if re.search(r"ddp/reducer/nccl\.hpp|cuda_allocator|pinned_allocator|<cuda", block):
        out.add("cuda")
    if "ddp/auth/sodium.hpp" in block:
        out.add("sodium")
    return out


def blocks(path):
    text = open(path, encoding="utf-8").read()
    for m in re.finditer(r"^```(?:cpp|c\+\+)\n(.*?)^```", text, re.S | re.M):
        yield text.count("\n", 0, m.start()) + 2, m.group(1)


def unit(block):
    if re.search(r"^\s*int\s+main\s*\(", block, re.M):
        return '#include "doc_context.hpp"\n' + block
    includes = [l for l in block.splitlines() if l.startswith("#include")]
    body = [l for l in block.splitlines() if not l.startswith("#include")]
    return ("\n".join(includes) + '\n#include "doc_context.hpp"\n'
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
sys.exit(1 if failed else 0)
