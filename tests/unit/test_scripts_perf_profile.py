"""scripts/perf_profile.py's attribution of perf samples to processes and kinds of code (a measurement tool's
pure part)."""

from __future__ import annotations

from scripts_module import load_script


def _load():
    return load_script("perf_profile")


# lines as `perf script -F pid,ip,dso` prints them
SCRIPT_TEXT = """\
    10  ffffffff81e7a115 ([kernel.kallsyms])
    10      7fc1ff564700 (/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0)
    10      7fc1ff564711 (/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0)
    11      7f223de440af (/work/main/.venv/lib/python3.11/site-packages/uvloop/loop.cpython-311-x86_64-linux-gnu.so)
    20      7f79f10b2fab (/tmp/perf-20.map)
    20      7f79f10b2fac ([JIT] tid 20)
    20      7f79f0000001 (/usr/lib/jvm/java-17-openjdk-amd64/lib/server/libjvm.so)
    30      55d2c0000001 (/usr/bin/redis-check-rdb)
    30      7f0000000001 (/usr/lib/x86_64-linux-gnu/libc.so.6)
    30      7fff00000001 ([vdso])
     0  ffffffff81e7a115 ([kernel.kallsyms])
    99      7f0000000001 (/usr/lib/x86_64-linux-gnu/libc.so.6)
not a sample line
"""


def test_samples_are_counted_per_process_and_kind_of_code():
    pp = _load()
    owner = {10: "connector-1", 11: "connector-1", 20: "kafka", 30: "redis"}
    samples = pp.tally(SCRIPT_TEXT, owner)
    assert {k: dict(v) for k, v in samples.items()} == {
        "connector-1": {"kernel": 1, "python": 2, "ext": 1},
        "kafka": {"jit": 2, "jvm": 1},
        "redis": {"ext": 1, "libc": 1, "other": 1},
    }  # pid 0 (the idle task) and 99 (not the suite's) are left out


def test_every_kind_of_code_is_one_of_the_printed_columns():
    pp = _load()
    for dso in ("[kernel.kallsyms]", "/x/libpython3.11.so.1.0", "[JIT] tid 7", "/tmp/perf-7.map",
                "/x/libjvm.so", "/x/libc.so.6", "/x/_message.abi3.so", "[vdso]", "[unknown]"):
        assert pp.kind_of(dso) in pp.KINDS
