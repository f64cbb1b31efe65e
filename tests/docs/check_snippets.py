#!/usr/bin/env python3
"""Compiles every ```cpp block of README.md and docs/*.md against the real headers.

A block with its own main() is compiled exactly as it is. Any other block goes inside a
function that first declares what the docs take as given (tests/docs/doc_context.hpp: pg, dp,
engine, ...), with its #include lines moved to the top. Nothing hides a missing include: a block
with #include lines compiles with those alone (the context declares ddp's classes without
defining them, and `dp` only when the block includes the wrapper); a block without any is a
fragment of a program that includes <ddp/ddp.hpp>, and gets just that. Blocks that include an
optional SDK's header (MPI, NCCL/CUDA, libsodium, oneTBB, LibTorch, Eigen, dlib) are compiled when that SDK's headers are found,
else reported as skipped. Blocks that need the same lines above them share a translation unit
(each in its own function); a unit that fails is split, so every failure names its block.

Then every name `ddp::NAME` that README.md mentions, in blocks or in running text, must be
offered by <ddp/ddp.hpp> alone (optional-SDK names excepted), and every type README.md writes
in running text (`ddp::basic_data_parallel<...>`) must be a complete type with it.

  check_snippets.py SOURCE_ROOT COMPILER [ARGS...]
"""
import concurrent.futures
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
    if os.path.exists("/usr/include/dlib/dnn.h"):
        flags["dlib"] = []
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
    if re.search(r"ddp/adapters/dlib\.hpp|<dlib/", block):
        out.add("dlib")
    return out


def blocks(path):
    text = open(path, encoding="utf-8").read()
    for m in re.finditer(r"^```(?:cpp|c\+\+)\n(.*?)^```", text, re.S | re.M):
        yield text.count("\n", 0, m.start()) + 2, m.group(1)


def has_main(block):
    return re.search(r"^\s*int\s+main\s*\(", block, re.M) is not None


def head(block):
    """What goes above a block that has no main(): its #include lines, then the context."""
    includes = [l for l in block.splitlines() if l.startswith("#include")]
    context = []
    if not includes:
        context += ["#define DDP_DOC_UMBRELLA", "#define DDP_DOC_WRAPPER"]
    elif any(re.search(r"<ddp/(ddp|data_parallel)\.hpp>", l) for l in includes):
        context += ["#define DDP_DOC_WRAPPER"]
    return "\n".join(includes + context) + '\n#include "doc_context.hpp"\n'


def function(block, n, where):
    """A block without main() as the body of a function; #line points errors at the document."""
    path, line = where.rsplit(":", 1)
    body = "\n".join(l if not l.startswith("#include") else "" for l in block.splitlines())
    return (f"int doc_snippet_{n}([[maybe_unused]] int argc, [[maybe_unused]] char** argv) {{\n"
            f"  DDP_DOC_CONTEXT\n  {{\n#line {line} \"{path}\"\n{body}\n  }}\n  return 0;\n}}\n")


flags = sdk_flags()
files = [os.path.join(root, "README.md")] + sorted(
    os.path.join(root, "docs", f) for f in os.listdir(os.path.join(root, "docs")) if f.endswith(".md"))
passed = failed = skipped = 0
tmp = tempfile.mkdtemp()


def compile_unit(text, extra):
    fd, src = tempfile.mkstemp(suffix=".cpp", dir=tmp)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    cmd = compiler + ["-std=c++20", "-fsyntax-only", "-Wall", "-Wextra",
                      "-I" + os.path.join(root, "include"), "-I" + os.path.join(root, "tests", "docs")] + extra + [src]
    return subprocess.run(cmd, capture_output=True, text=True)


# Blocks with their own main() compile alone. The others compile as functions, grouped by what
# goes above them (the same #include lines and context, so no block sees an include it lacks):
# one translation unit per group, and a group that fails is split so each failure names its
# block. The units compile side by side, one per core.
alone, groups = [], {}
for path in files:
    for line, block in blocks(path):
        where = f"{os.path.relpath(path, root)}:{line}"
        missing = [s for s in sorted(needs(block)) if s not in flags]
        if missing:
            print(f"SKIP {where}: no {', '.join(missing)} headers here")
            skipped += 1
            continue
        extra = [f for s in sorted(needs(block)) for f in flags[s]]
        if has_main(block):
            alone.append((where, block, extra))
        else:
            groups.setdefault((head(block), tuple(extra)), []).append((where, block))


def check_alone(where, block, extra):
    res = compile_unit(block, extra)
    return [(where, block, res)]


def check_group(top, extra, members):
    text = top + "".join(function(block, n, where) for n, (where, block) in enumerate(members))
    res = compile_unit(text, list(extra))
    if res.returncode == 0 or len(members) == 1:
        return [(where, block, res) for where, block in members]
    return [(where, block, compile_unit(top + function(block, 0, where), list(extra))) for where, block in members]


with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
    jobs = [pool.submit(check_alone, *a) for a in alone]
    jobs += [pool.submit(check_group, top, extra, members) for (top, extra), members in groups.items()]
    for job in jobs:
        for where, block, res in job.result():
            if res.returncode == 0:
                passed += 1
            else:
                failed += 1
                print(f"FAIL {where}: this code block does not compile:\n{block}\n{res.stderr}")
shutil.rmtree(tmp, ignore_errors=True)
print(f"doc snippets: {passed} compile, {failed} fail, {skipped} skipped")

# What README.md names must come with <ddp/ddp.hpp> alone. The optional parts have their own
# headers (README says which), so they are not expected from the umbrella.
OPTIONAL = {"nccl_reducer", "mpi_reducer", "cuda_allocator", "pinned_allocator", "sodium_authenticator",
            "use_tbb", "set_kernel_threads", "detail", "torch_parameters", "torch_data_parallel",
            "eigen_parameters", "dlib_parameters",
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
