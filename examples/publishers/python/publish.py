"""Publish relayhost events from Python, in the same transaction as the business data."""
import datetime
import sys
import uuid

from pymongo import MongoClient, ReturnDocument


def publish(db, session, event_type, payload, key=None, event_id=None, headers=None,
            correlation_id=None, causation_id=None, prefix="relayhost_"):
    """Writes one event inside the session's transaction. Returns its id, or None when an
    event with this id exists already (a retry: nothing is written)."""
    event_id = event_id or str(uuid.uuid4())
    events = db[prefix + "events"]
    if events.find_one({"_id": event_id}, {"_id": 1}, session=session):
        return None
    event = {"type": event_type, "payload": payload,
             "createdAt": datetime.datetime.now(datetime.timezone.utc)}
    if key is not None:
        # Same transaction: concurrent publishers of a key conflict here, so the
        # sequence order of a key is its commit order.
        counter = db[prefix + "key_sequences"].find_one_and_update(
            {"_id": key}, {"$inc": {"value": 1}}, upsert=True,
            return_document=ReturnDocument.AFTER, session=session)
        event["key"] = key
        event["sequence"] = counter["value"]
    if headers:
        event["headers"] = headers
    if correlation_id:
        event["correlationId"] = correlation_id
    if causation_id:
        event["causationId"] = causation_id
    # An upsert, so that two transactions racing on one id meet as a retryable conflict.
    events.update_one({"_id": event_id}, {"$setOnInsert": event}, upsert=True, session=session)
    return event_id


def place_order(client, db, order_id, customer, total, abort=False):
    def work(session):
        db.orders.insert_one({"_id": order_id, "customer": customer, "total": total}, session=session)
        publish(db, session, "order.placed", {"orderId": order_id, "total": total},
                key=customer, event_id="order-placed-" + order_id)
        if abort:
            raise RuntimeError("payment declined")  # aborts: no order, no event
    with client.start_session() as session:
        session.with_transaction(work)


if __name__ == "__main__":
    uri, database, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    prefix = next((arg.split("=", 1)[1] for arg in sys.argv if arg.startswith("--id-prefix=")), "")
    client = MongoClient(uri)
    db = client[database]
    for n in range(count):
        abort = "--abort-odd" in sys.argv and n % 2 == 1
        try:
            place_order(client, db, "%so-%d" % (prefix, n), "customer-%d" % (n % 3), 10 * n, abort=abort)
        except RuntimeError:
            pass
