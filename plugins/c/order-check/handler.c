// A relayhost handler in C: checks each placed order and logs it, as the Python and
// JavaScript order checks do. Bindings from `wit-bindgen c` (plugin.h), built into a
// component by scripts/build-plugins.sh with clang, wasi-libc and `wasm-tools component new`.
//
// What the host hands back is freed by the bindings after the call returns (the
// `cabi_post_*` functions), so every string returned is allocated (`plugin_string_dup`).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "plugin.h"

// The value of `"name":` at the top level of `json` (relaxed extended JSON of a flat
// document), or NULL. Enough for this example's payloads; a real handler would use a JSON
// library compiled for wasm32-wasi.
static const char *field(const char *json, const char *name) {
    char quoted[64];
    snprintf(quoted, sizeof quoted, "\"%s\"", name);
    const char *at = strstr(json, quoted);
    if (at == NULL) {
        return NULL;
    }
    at = strchr(at + strlen(quoted), ':');
    if (at == NULL) {
        return NULL;
    }
    at++;
    while (*at == ' ') {
        at++;
    }
    return at;
}

void exports_relayhost_plugin_handler_subscriptions(exports_relayhost_plugin_handler_list_subscription_t *ret) {
    exports_relayhost_plugin_handler_subscription_t *subscription = calloc(1, sizeof *subscription);
    plugin_string_dup(&subscription->handler, "c-order-check");
    subscription->event_types.len = 1;
    subscription->event_types.ptr = calloc(1, sizeof(plugin_string_t));
    plugin_string_dup(&subscription->event_types.ptr[0], "order.placed");
    subscription->transactional = false;
    ret->ptr = subscription;
    ret->len = 1;
}

bool exports_relayhost_plugin_handler_handle(
    exports_relayhost_plugin_handler_event_t *event,
    exports_relayhost_plugin_handler_delivery_context_t *context,
    exports_relayhost_plugin_handler_failure_t *err) {
    // The payload is not NUL-terminated.
    char *payload = strndup((const char *)event->payload.ptr, event->payload.len);
    const char *order_id = field(payload, "orderId");
    const char *total = field(payload, "total");
    bool ok = true;
    if (order_id == NULL || *order_id != '"') {
        err->tag = RELAYHOST_PLUGIN_TYPES_FAILURE_UNPROCESSABLE;
        plugin_string_dup(&err->val.unprocessable, "order without orderId");
        ok = false;
    } else if (total != NULL && strtod(total, NULL) < 0) {
        err->tag = RELAYHOST_PLUGIN_TYPES_FAILURE_RETRY;
        plugin_string_dup(&err->val.retry.reason, "negative total, asking again later");
        err->val.retry.not_before.is_some = false;
        ok = false;
    } else {
        const char *end = strchr(order_id + 1, '"');
        int id_len = end == NULL ? 0 : (int)(end - order_id - 1);
        char line[256];
        snprintf(line, sizeof line, "order %.*s checked on attempt %u", id_len, order_id + 1, context->attempt);
        plugin_string_t message;
        plugin_string_set(&message, line);
        relayhost_plugin_log_log(RELAYHOST_PLUGIN_LOG_LEVEL_INFO, &message);
    }
    free(payload);
    exports_relayhost_plugin_handler_event_free(event);
    exports_relayhost_plugin_handler_delivery_context_free(context);
    return ok;
}
