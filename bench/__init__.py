"""tbmq-py benchmark: a fast multi-process MQTT load generator and the reference scenarios, run side by side
against tbmq-py (via tbmq_launcher), Mosquitto and amqtt. `python -m bench --help`."""
