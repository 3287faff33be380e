"""The shared-prefix workload of ``pagedkv bench router`` and its table (no processes)."""

from collections import Counter

from rich.console import Console

from pagedkv.bench.router import RouterConfig, RouterResult, RouterRun, RouterWorkload, print_router


def test_every_user_of_every_system_prompt_once_in_a_seeded_shuffle():
    workload = RouterWorkload(num_systems=3, users_per_system=5, system_words=20)
    prompts = workload.requests(tag="run a")
    assert len(prompts) == 15 and len(set(prompts)) == 15
    systems = Counter(p.split("\nuser ")[0] for p in prompts)
    assert sorted(systems.values()) == [5, 5, 5]
    assert all(p.startswith("run a system ") for p in prompts)
    assert prompts == workload.requests(tag="run a")  # seeded
    order = [p.split(":")[0] for p in prompts]
    assert order != sorted(order), "shuffled, so round robin cannot partition the systems by accident"
    # Another tag changes only the front: same shape, nothing shared with the first run.
    other = workload.requests(tag="run b")
    assert [p.replace("run b", "run a") for p in other] == prompts


def test_the_table_gives_each_setup_its_share_of_the_single_replica_hit_rate():
    runs = [
        RouterRun("single replica, 2x KV", 0.8, 0.05, 0.1, (256,), 7.0),
        RouterRun("2 replicas, round_robin", 0.4, 0.02, 0.05, (128, 128), 3.0),
    ]
    result = RouterResult(RouterConfig(), runs)
    assert result.ok  # every setup served all 8 x 32 requests
    console = Console(record=True, width=120)
    print_router(result, console)
    single, pair = (line for line in console.export_text().splitlines() if "replica" in line)
    assert "100%" in single and "50%" in pair and "128/128" in pair
    assert not RouterResult(
        RouterConfig(), [*runs[:1], RouterRun("lost", 0.4, 0.02, 0.05, (128, 127), 3.0)]
    ).ok
