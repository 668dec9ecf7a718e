"""mmaccel.speculative: planned module (see the issue tracker). Its registry is empty for now."""

METHODS: dict = {}

