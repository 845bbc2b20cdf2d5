// A relayhost handler in JavaScript: checks each placed order and logs it.
// Built into a component with componentize-js (scripts/build-plugins.sh).
import { log } from 'relayhost:plugin/log@0.1.0';

export const handler = {
  subscriptions() {
    return [{ handler: 'js-order-check', eventTypes: ['order.placed'], transactional: false }];
  },

  handle(event, context) {
    const order = JSON.parse(event.payload);
    if (!order.orderId) {
      throw { tag: 'unprocessable', val: 'order without orderId' };
    }
    if ((order.total ?? 0) < 0) {
      throw { tag: 'retry', val: { reason: 'negative total, asking again later', notBefore: undefined } };
    }
    log('info', `order ${order.orderId} checked on attempt ${context.attempt}`);
  },
};
