"""device-persistence's core as a library: the Redis store of persistent DEVICE clients' messages (store.py and
the scripts in lua/), the Forward streams to the connectors (forward.py), the DevicePersistence gRPC API
(grpc_api.py) and the service that ties them together (service.py, whose docstring states the guarantee).

The `device-persistence` service (services/device-persistence) runs it. Services import libs, never each
other: this is the one home of that code, for every process that runs it.
"""
