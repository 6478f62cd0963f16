"""Local stack for tbmq-py: a Kafka broker from Maven Central jars, Redis, topic creation, and the services
started in order with readiness checks. `python -m tbmq_launcher run` runs it; tests/conftest.py uses it.

    from tbmq_launcher import KafkaBroker, Suite
"""

from .kafka import KafkaBroker, KafkaStartError
from .launcher import Suite, SuiteError
from .services import ORDER, SERVICES, ServiceDef, ServiceProcess, ServiceStartError

__all__ = ["KafkaBroker", "KafkaStartError", "Suite", "SuiteError", "ORDER", "SERVICES", "ServiceDef",
           "ServiceProcess", "ServiceStartError"]
