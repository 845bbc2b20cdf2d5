"""A relayhost handler in Python: checks each placed order and logs it.

Build: componentize-py -d wit -w plugin componentize app -p plugins/python/order-check -o py_order_check.wasm
"""
import json

from componentize_py_types import Err
from wit_world import exports
from wit_world.imports import log, types


class Handler(exports.Handler):
    def subscriptions(self):
        return [types.Subscription(handler="py-order-check", event_types=["order.placed"], transactional=False)]

    def handle(self, event, context):
        order = json.loads(event.payload)
        if "orderId" not in order:
            raise Err(types.Failure_Unprocessable("order without orderId"))
        if order.get("total", 0) < 0:
            raise Err(types.Failure_Retry(types.Retry(reason="negative total, asking again later", not_before=None)))
        log.log(log.Level.INFO, f"order {order['orderId']} checked on attempt {context.attempt}")
