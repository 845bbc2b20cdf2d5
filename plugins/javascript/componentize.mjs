// Builds a JavaScript handler into a WebAssembly component with componentize-js's library
// API: node componentize.mjs <handler.js> <wit dir> <out.wasm>
import { readFile, writeFile } from 'node:fs/promises';
import { componentize } from '@bytecodealliance/componentize-js';

const [source, witPath, out] = process.argv.slice(2);
const { component } = await componentize({
  sourcePath: source,
  witPath,
  worldName: 'plugin',
  disableFeatures: ['http', 'fetch-event'],
});
await writeFile(out, component);
