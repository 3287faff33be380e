"""The decode-attention benchmark times quantized pools beside the unquantized one, and checks
every method's output against SDPA before timing it."""

from tools import attention


def test_quantized_pools_are_timed_in_the_same_run(capsys):
    argv = ["--batches", "2", "--contexts", "40", "--repeats", "1", "--heads", "4", "--kv-heads", "2"]
    argv += ["--head-dim", "16", "--backends", "cpu", "--kv-cache-dtypes", "auto", "fp8", "int8"]
    attention.main(argv)
    out = capsys.readouterr().out
    for name in ("paged:cpu ", "paged:cpu:fp8", "paged:cpu:int8"):
        assert name in out
    assert "paged:cpu:fp8 vs paged:cpu:" in out and "paged:cpu:int8 vs paged:cpu:" in out
