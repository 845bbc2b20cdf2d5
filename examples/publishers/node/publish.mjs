// Publish relayhost events from Node.js, in the same transaction as the business data.
import { randomUUID } from 'node:crypto';
import { MongoClient } from 'mongodb';

/** Writes one event inside the session's transaction. Returns its id, or null when an event
 * with this id exists already (a retry: nothing is written). */
export async function publish(db, session, type, payload, options = {}) {
  const { key, id = randomUUID(), headers, correlationId, causationId, prefix = 'relayhost_' } = options;
  const events = db.collection(prefix + 'events');
  if (await events.findOne({ _id: id }, { projection: { _id: 1 }, session })) {
    return null;
  }
  const event = { type, payload, createdAt: new Date() };
  if (key !== undefined) {
    // Same transaction: concurrent publishers of a key conflict here, so the sequence
    // order of a key is its commit order.
    const counter = await db.collection(prefix + 'key_sequences').findOneAndUpdate(
      { _id: key }, { $inc: { value: 1 } }, { upsert: true, returnDocument: 'after', session });
    event.key = key;
    event.sequence = counter.value;
  }
  if (headers) event.headers = headers;
  if (correlationId) event.correlationId = correlationId;
  if (causationId) event.causationId = causationId;
  // An upsert, so that two transactions racing on one id meet as a retryable conflict.
  await events.updateOne({ _id: id }, { $setOnInsert: event }, { upsert: true, session });
  return id;
}

async function placeOrder(client, db, orderId, customer, total, abort) {
  const session = client.startSession();
  try {
    await session.withTransaction(async () => {
      await db.collection('orders').insertOne({ _id: orderId, customer, total }, { session });
      await publish(db, session, 'order.placed', { orderId, total }, { key: customer, id: 'order-placed-' + orderId });
      if (abort) throw new Error('payment declined'); // aborts: no order, no event
    });
  } catch (error) {
    if (!abort) throw error;
  } finally {
    await session.endSession();
  }
}

if (import.meta.url === `file://${process.argv[1]}`) {
  const [uri, database, count] = process.argv.slice(2);
  const prefix = (process.argv.find((arg) => arg.startsWith('--id-prefix=')) ?? '=').split('=')[1];
  const client = await new MongoClient(uri).connect();
  const db = client.db(database);
  for (let n = 0; n < Number(count); n++) {
    const abort = process.argv.includes('--abort-odd') && n % 2 === 1;
    await placeOrder(client, db, `${prefix}o-${n}`, `customer-${n % 3}`, 10 * n, abort);
  }
  await client.close();
}
