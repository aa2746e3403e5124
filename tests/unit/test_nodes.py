"""`parallel.nodes`: the node of a torchrun rank and the address other nodes reach it at."""

import pytest

from megatron_rl.parallel.nodes import NodeInfo, node_address, node_info


def test_a_plain_process_is_node_0_of_1():
    assert node_info({}) == NodeInfo(0, 1, 0, 1) and node_info({}).is_leader


def test_torchrun_variables_give_the_node_and_the_local_rank():
    env = {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "RANK": "11", "LOCAL_RANK": "3", "GROUP_RANK": "1"}
    assert node_info(env) == NodeInfo(node_rank=1, nnodes=2, local_rank=3, local_world_size=8)
    assert not node_info(env).is_leader
    # without GROUP_RANK (megatron-rl's own spawn): the node from the global rank
    assert node_info({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "RANK": "2", "LOCAL_RANK": "0"}) == NodeInfo(1, 2, 0, 2)


def test_nodes_of_unequal_size_are_refused():
    with pytest.raises(ValueError, match="WORLD_SIZE 6 is not a multiple of LOCAL_WORLD_SIZE 4"):
        node_info({"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4", "RANK": "0"})


def test_the_address_towards_a_loopback_peer_is_loopback():
    assert node_address("127.0.0.1").startswith("127.")
