"""The KV-capacity autoscaling arithmetic and policy (engine-free: Serve's own context
object, filled as Serve's controller fills it)."""
import pytest
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from spyre_serve.serve.kv_autoscaling import (CAPACITY, DEMAND, PREEMPTIONS, KVCapacityPolicy,
                                        autoscaling_stats, kv_demand_tokens, replicas_for_kv)


def test_demand_counts_held_blocks_and_waiting_requests_at_the_running_average():
    assert kv_demand_tokens(used_blocks=0, block_size=64, running=0, waiting=0) == 0
    # 10 blocks held by 2 requests (320 tokens each on average); 3 waiting ones like them.
    assert kv_demand_tokens(10, 64, running=2, waiting=3) == 640 + 3 * 320
    # Nothing runs yet: a waiting request needs at least one block.
    assert kv_demand_tokens(0, 64, running=0, waiting=4) == 4 * 64


def test_stats_report_capacity_in_tokens_of_the_usable_blocks():
    stats = autoscaling_stats(used_blocks=5, usable_blocks=99, block_size=64, running=1,
                              waiting=0, preemptions_per_s=0.5)
    assert stats == {DEMAND: 320.0, CAPACITY: 99 * 64.0, PREEMPTIONS: 0.5}


@pytest.mark.parametrize("demand, preempting, current, expected", [
    (0, False, 2, 0),          # idle: Serve's min_replicas bounds it, not us
    (800, False, 1, 1),        # 800 of 1000 tokens = the 0.8 target
    (801, False, 1, 2),        # just above the target: one more replica
    (1500, False, 3, 2),       # 3 replicas hold 1500 at 0.5; 2 hold it at 0.75: scale down
    (100, True, 2, 3),         # preemptions: the cards are short whatever the average says
])
def test_replicas_for_kv(demand, preempting, current, expected):
    assert replicas_for_kv(demand, 1000, 0.8, preempting, current) == expected


def context(current: int, demand: dict, capacity: dict, preemptions: dict,
            ongoing: float, target_ongoing: float = 16) -> AutoscalingContext:
    config = AutoscalingConfig(min_replicas=1, max_replicas=8,
                               target_ongoing_requests=target_ongoing)
    replicas = list(capacity)
    return AutoscalingContext(
        deployment_id=None, deployment_name="SpyreLLM", app_name="app",
        current_num_replicas=current, target_num_replicas=current, running_replicas=replicas,
        total_num_requests=ongoing, total_queued_requests=0,
        aggregated_metrics={DEMAND: demand, CAPACITY: capacity, PREEMPTIONS: preemptions},
        raw_metrics={}, capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=8,
        policy_state={}, last_scale_up_time=None, last_scale_down_time=None,
        current_time=0.0, config=config)


def test_few_long_requests_scale_up_where_the_request_rule_would_not():
    # 2 ongoing requests against a target of 16: Serve's rule alone wants fewer replicas.
    ctx = context(1, {"r1": 6000.0}, {"r1": 6336.0}, {"r1": 0.0}, ongoing=2)
    desired, state = KVCapacityPolicy(0.8)(ctx)
    assert desired == 2 and state["kv"]["replicas_for_requests"] < 1


def test_many_short_requests_still_scale_by_the_request_rule():
    ctx = context(1, {"r1": 640.0}, {"r1": 6336.0}, {"r1": 0.0}, ongoing=64)
    desired, _ = KVCapacityPolicy(0.8)(ctx)
    assert desired == 4  # 64 ongoing / 16 per replica; KV alone would keep 1


def test_preemption_adds_a_replica_and_idle_replicas_scale_down():
    busy = context(2, {"r1": 100.0, "r2": 100.0}, {"r1": 6336.0, "r2": 6336.0},
                   {"r1": 0.2, "r2": 0.0}, ongoing=2)
    assert KVCapacityPolicy()(busy)[0] == 3
    idle = context(2, {"r1": 0.0, "r2": 0.0}, {"r1": 6336.0, "r2": 6336.0},
                   {"r1": 0.0, "r2": 0.0}, ongoing=0)
    assert KVCapacityPolicy()(idle)[0] == 0  # Serve's wrapper holds it at min_replicas


def test_bad_target_is_refused_naming_it():
    with pytest.raises(ValueError, match="target_kv_utilization=1.5"):
        KVCapacityPolicy(1.5)
