"""``nats-kill``'s pure parts: which servers a bus URL names, which socket listens on a port."""

from __future__ import annotations

from bench.soak_cluster import cluster_urls, listening_inodes, local_servers, url_port

TABLE = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1092 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 5551 1
   1: 0100007F:1092 0100007F:D2F0 01 00000000:00000000 00:00000000 00000000     0        0 5552 1
   2: 00000000:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 5553 1
"""


def test_only_the_listening_socket_of_the_port_is_found() -> None:
    # 0x1092 = 4242: the listener (st 0A) counts, the established connection on it does not
    assert listening_inodes(TABLE, 4242) == {5551}
    assert listening_inodes(TABLE, 8080) == {5553}
    assert listening_inodes(TABLE, 4222) == set()
    assert listening_inodes("", 4242) == set()


def test_a_cluster_url_names_each_server_and_its_port() -> None:
    url = "tls://nats-1:4222, tls://nats-2:4223,nats://127.0.0.1"
    assert cluster_urls(url) == ["tls://nats-1:4222", "tls://nats-2:4223", "nats://127.0.0.1"]
    assert [url_port(u) for u in cluster_urls(url)] == [4222, 4223, 4222]
    assert url_port("127.0.0.1:5000") == 5000


def test_a_single_server_is_no_cluster_to_fault() -> None:
    assert local_servers("nats://127.0.0.1:4222") == []
