"""tbmq-py router: a Faust app that routes every record of tbmq.msg.all (see docs/router.md)."""
