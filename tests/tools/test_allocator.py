"""The allocator benchmark runs the engine's own block tables: a fork shares every block, the
first write to a partial last block copies it once, and every block goes back."""

from tools import allocator


def test_every_child_copies_its_partial_last_block_once_and_nothing_leaks(capsys):
    figures = allocator.run(num_tokens=2_000, num_tables=20, block_size=16)  # 100 tokens: 6 blocks + 4
    assert figures["copies made"] == 20
    assert all(value > 0 for value in figures.values())
    allocator.main(["--tokens", "3200", "--tables", "20"])  # 160 tokens: whole blocks, no copy
    lines = dict(line.rsplit(None, 1) for line in capsys.readouterr().out.splitlines())
    assert float(lines["copies made"]) == 0.0
