"""kernels/optional_arguments.py: the compile-time check that a kernel was compiled with None
exactly where it does not read an optional argument (CPU; the kernels call it in __call__)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cute_flash.kernels.optional_arguments import check_given

REPO = Path(__file__).resolve().parent.parent


def test_arguments_that_match_what_the_kernel_reads_pass():
    check_given("k", ("a", "b", "c"), (object(), None, object()), (True, False, True))
    check_given("k", (), (), ())


@pytest.mark.parametrize("arguments, wrong", [
    ((object(), object(), object()), ["b (given, not read)"]),
    ((None, None, object()), ["a (None, read)"]),
    ((None, object(), None), ["a (None, read)", "b (given, not read)", "c (None, read)"]),
])
def test_a_tensor_where_none_is_read_or_none_where_one_is_raises_naming_each(arguments, wrong):
    with pytest.raises(ValueError) as error:
        check_given("the forward", ("a", "b", "c"), arguments, (True, False, True))
    message = str(error.value)
    assert message.startswith("the forward: ")
    for item in wrong:
        assert item in message
    for name in {"a", "b", "c"} - {w[0] for w in wrong}:
        assert f"{name} (" not in message


# Compiles the split merge (kernels/split_merge.py, the smallest kernel with an optional argument)
# with a sink tensor where the kernel reads none, or None where it reads one.
CHILD = textwrap.dedent("""
    import sys
    import cutlass.cute as cute
    from cutlass import Float16, Float32
    from cute_flash.compile_cache import compile_kernel, fake_row_tensor, fake_sink_tensor
    from cute_flash.kernels.split_merge import SplitMerge
    reads_sink = sys.argv[1] == "reads"
    rows = lambda: fake_row_tensor(Float16, 64)
    lse = lambda: fake_row_tensor(Float32, cute.sym_int32(), rank=3)
    try:
        compile_kernel(SplitMerge(Float16, 64, reads_sink), rows(), lse(), None if reads_sink else fake_sink_tensor(),
                       rows(), lse())
    except Exception as error:
        print("raised", type(error).__name__, str(error).splitlines()[0] if str(error) else "")
    else:
        print("compiled")
""")


@pytest.mark.sass
@pytest.mark.parametrize("reads, wrong", [("reads", "sink (None, read)"), ("not", "sink (given, not read)")])
def test_a_kernel_compiled_against_what_it_reads_fails_to_compile(reads, wrong):
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a")
    proc = subprocess.run([sys.executable, "-c", CHILD, reads], cwd=REPO, env=env, text=True, capture_output=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("raised") and "the split merge" in last and wrong in last, proc.stdout + proc.stderr
