// The in-memory store (dry runs, unit tests) against the shared contract.
import { defineContractSuite } from './contract.ts';
import { memoryHarness } from './harnesses.ts';

defineContractSuite(memoryHarness());
