"""Waits until the demo's host has delivered everything, then prints what the plugins wrote."""
import sys
import time

from pymongo import MongoClient

uri, database, expected_audits, expected_alerts = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
db = MongoClient(uri)[database]
deadline = time.time() + 60
while (db.audit_log.count_documents({}) < expected_audits
       or db.dead_letter_alerts.count_documents({}) < expected_alerts
       or db.relayhost_deliveries.count_documents({"status": "pending"}) > 0):
    if time.time() > deadline:
        sys.exit("the host did not deliver everything within a minute")
    time.sleep(0.1)

print("\nthe audit-log projection (written by the Rust plugin inside each delivery's transaction):")
for record in db.audit_log.find().sort([("key", 1), ("sequence", 1)]):
    print("  %-20s %-11s #%s  total %s" % (record["_id"], record["key"], record["sequence"], record["payload"]["total"]))
print("each customer's orders, in the order they were handled:")
for key in db.audit_order.find().sort("_id", 1):
    print("  %-11s %s" % (key["_id"], ", ".join(key["events"])))
print("dead letters announced by the host and recorded by the dead-letter-alert plugin:")
for alert in db.dead_letter_alerts.find():
    print("  %s -> %s after %s attempt(s): %s" % (alert["eventId"], alert["handler"], alert["attempts"], alert["lastError"]))
