"""A worker's advertised address when VIGIL_NODE_ADDRESS is unset: the one it reaches NATS from."""

from vigil_common.addresses import advertised_address, source_address


def test_an_address_set_is_kept_and_an_unset_one_is_the_source_toward_nats():
    assert advertised_address("10.0.0.5", "nats://127.0.0.1:4222") == "10.0.0.5"
    assert advertised_address(None, "nats://127.0.0.1:4222") == "127.0.0.1"
    assert advertised_address(None, None) == "127.0.0.1"  # one machine, nothing to ask
    assert source_address("nats://no-such-host.invalid:4222") is None
