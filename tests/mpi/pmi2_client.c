/* A PMI-2 client built on Slurm's libpmi2 (Debian's libpmi2-0-dev), not on our code:
 * fullinit, job id, kvs put, fence, get of every rank's key, and a node attribute read with
 * wait=TRUE before rank 0 puts it (rank 0 waits for the file named by PMI2T_GO_FILE first).
 */
#include <slurm/pmi2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define CHECK(call) do { int rc_ = (call); if (rc_ != PMI2_SUCCESS) { \
    fprintf(stderr, "%s failed: %d\n", #call, rc_); return 10; } } while (0)

int main(void) {
    int spawned, size, rank, appnum, len, found;
    char jobid[256], key[64], val[256], buf[1024];
    CHECK(PMI2_Init(&spawned, &size, &rank, &appnum));
    CHECK(PMI2_Job_GetId(jobid, sizeof jobid));
    snprintf(key, sizeof key, "key-%d", rank);
    snprintf(val, sizeof val, "value;of;rank-%d", rank);  /* ';' is escaped on the wire */
    CHECK(PMI2_KVS_Put(key, val));
    CHECK(PMI2_KVS_Fence());
    for (int r = 0; r < size; r++) {
        snprintf(key, sizeof key, "key-%d", r);
        snprintf(val, sizeof val, "value;of;rank-%d", r);
        CHECK(PMI2_KVS_Get(jobid, PMI2_ID_NULL, key, buf, sizeof buf, &len));
        if (strcmp(buf, val) != 0) {
            fprintf(stderr, "rank %d: %s is %s, not %s\n", rank, key, buf, val);
            return 11;
        }
    }
    CHECK(PMI2_Info_GetJobAttr("PMI_process_mapping", buf, sizeof buf, &found));
    if (!found) { fprintf(stderr, "no PMI_process_mapping\n"); return 12; }
    if (rank == 0) {
        const char *go = getenv("PMI2T_GO_FILE");
        while (go && access(go, F_OK) != 0)
            usleep(10000);
        CHECK(PMI2_Info_PutNodeAttr("nattr", "hello"));
    } else {
        CHECK(PMI2_Info_GetNodeAttr("nattr", buf, sizeof buf, &found, 1));
        if (!found || strcmp(buf, "hello") != 0) {
            fprintf(stderr, "rank %d: node attr %d %s\n", rank, found, buf);
            return 13;
        }
    }
    CHECK(PMI2_Finalize());
    printf("rank %d of %d OK jobid=%s\n", rank, size, jobid);
    return 0;
}
