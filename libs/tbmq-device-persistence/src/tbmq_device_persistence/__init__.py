"""device-persistence's core as a library: the Redis store of persistent DEVICE clients' messages (store.py and
the scripts in lua/), the Forward streams to the connectors (forward.py), the DevicePersistence gRPC API
(grpc_api.py) and the service that ties them together (service.py, whose docstring states the guarantee).

The `device-persistence` service (services/device-persistence) runs it alone; the router runs it in its own
process with ROUTER_PERSIST_VIA=local (docs/router.md), so that the copies it routes are saved without a
Persist stream. Services import libs, never each other: this is the one home of that code.
"""
