"""A second tier that cannot fit is refused at start-up, with the figures to change."""

from __future__ import annotations

import shutil

import pytest

from pagedkv.memory.tier.limits import available_host_memory, check_disk_tier, check_host_tier


def test_a_host_tier_larger_than_the_available_memory_is_refused_with_the_figures():
    available = available_host_memory()
    assert available > 0
    check_host_tier(1 << 20)  # one MiB fits anywhere this suite runs
    figures = r"--kv-offloading-size .* GiB \(\d+ bytes\) is more than the host memory available"
    with pytest.raises(ValueError, match=figures) as err:
        check_host_tier(2 * available + (1 << 30))
    assert "MemAvailable" in str(err.value) and "Lower --kv-offloading-size" in str(err.value)
    with pytest.raises(ValueError, match="must be positive"):
        check_host_tier(0)


def test_a_disk_tier_larger_than_the_free_space_is_refused_with_the_figures(tmp_path):
    folder = tmp_path / "tier" / "nested"
    check_disk_tier(folder, 1 << 20)
    assert folder.is_dir() and list(folder.iterdir()) == []  # created, and the probe is gone
    free = shutil.disk_usage(folder).free
    with pytest.raises(ValueError, match=r"more than the disk tier can take in .*nested: .* GiB .* free"):
        check_disk_tier(folder, 2 * free + (1 << 30))


def test_the_block_files_a_restart_reuses_count_as_room(tmp_path):
    held = 1 << 40  # a sparse file: its size counts, it takes no space (others share this disk)
    with open(tmp_path / "0000000000000001.r0.kvblock", "wb") as f:
        f.truncate(held)
    free = shutil.disk_usage(tmp_path).free
    check_disk_tier(tmp_path, free + held // 2)  # the existing file's bytes are the tier's own
    with pytest.raises(ValueError, match=r"free plus 1024.00 GiB"):
        check_disk_tier(tmp_path, free + 2 * held)


def test_an_unwritable_folder_is_refused(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(ValueError, match=r"--kv-offload-dir .*a-file/tier is not a writable folder"):
        check_disk_tier(blocker / "tier", 1 << 20)
