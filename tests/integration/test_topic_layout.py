"""ensure_topics with a TopicLayout on the real (single) broker: min.insync.replicas is set on the topics it
creates, and a replication factor the cluster cannot hold fails loudly instead of creating a weaker topic."""

from __future__ import annotations

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from tbmq_platform import topics as catalogue
from tbmq_platform.kafka import ensure_topics

pytestmark = pytest.mark.integration


async def test_created_topics_carry_the_layout(kafka, unique):
    bs = kafka.bootstrap_servers
    name = unique("layout")
    layout = catalogue.TopicLayout(catalogue.SINGLE_NODE, replication_factor=1, min_insync_replicas=1)
    assert await ensure_topics(bs, [catalogue.TopicSpec(name, "k", "bytes", 4, "t", "t", single_node_partitions=1)],
                               layout=layout) == [name]
    admin = AIOKafkaAdminClient(bootstrap_servers=bs)
    await admin.start()
    try:
        [resp] = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, name, configs={"min.insync.replicas": None})])
        cfg = {e[0]: e[1] for r in resp.resources for e in r[4]}
        assert cfg["min.insync.replicas"] == "1"
        [meta] = (await admin.describe_topics([name]))
        assert len(meta["partitions"]) == 1  # the single-node profile
    finally:
        await admin.close()


async def test_a_replication_factor_above_the_broker_count_fails(kafka, unique):
    name = unique("layout-rf")
    with pytest.raises(RuntimeError, match=name):
        await ensure_topics(kafka.bootstrap_servers, [catalogue.TopicSpec(name, "k", "bytes", 1, "t", "t")],
                            layout=catalogue.TopicLayout(replication_factor=3, min_insync_replicas=2))
