"""tbmq_connection: one MQTT connection's session logic as a pure, sans-io state machine.

`ConnectionMachine` (machine.py) is fed decoded packets and events with the time passed in and answers
with effects (effects.py); the pure parts it is made of: CONNECT planning (connect.py), packet <-> Kafka
payload conversion (convert.py), flow control (flow.py). No asyncio, Kafka, Redis or gRPC here.
"""

from .effects import *  # noqa: F401,F403
from .effects import __all__ as _effects_all
from .machine import (
    CLOSED,
    CONNECT_TIMEOUT,
    CONNECTED,
    CONNECTING,
    KEEP_ALIVE,
    NEW,
    TOKEN_EXPIRY,
    ConnectionMachine,
    MachineConfig,
)

__all__ = [*_effects_all, "CLOSED", "CONNECT_TIMEOUT", "CONNECTED", "CONNECTING", "ConnectionMachine",
           "KEEP_ALIVE", "MachineConfig", "NEW", "TOKEN_EXPIRY"]
