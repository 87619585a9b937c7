import { defineCaseTests } from '../helpers.ts';

defineCaseTests('elementwise');
