{{/* Chart name, possibly overridden. */}}
{{- define "nodepulse.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* Prefix of every object name: <release>-nodepulse, or the release name when it
already says nodepulse. Kept short so "-agent-<ordinal>-<i>" still fits a label. */}}
{{- define "nodepulse.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "nodepulse.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "nodepulse.operator.fullname" -}}{{ include "nodepulse.fullname" . }}-operator{{- end -}}
{{- define "nodepulse.agent.fullname" -}}{{ include "nodepulse.fullname" . }}-agent{{- end -}}

{{- define "nodepulse.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "nodepulse.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "nodepulse.operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "nodepulse.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "nodepulse.agent.selectorLabels" -}}
app.kubernetes.io/name: {{ include "nodepulse.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: agent
{{- end -}}

{{- define "nodepulse.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The leader-election Lease's name (in the release namespace). */}}
{{- define "nodepulse.operator.electionLease" -}}{{ include "nodepulse.operator.fullname" . }}{{- end -}}

{{/* The names of every Node (and Lease) the agents register: agent pod
<fullname>-agent-<ordinal> passes --node-name-prefix "<pod name>-", and the agent names
its nodes <prefix><i> for i in 0..nodesPerReplica-1. One name per line. */}}
{{- define "nodepulse.agent.nodeNames" -}}
{{- $base := include "nodepulse.agent.fullname" . -}}
{{- range $ordinal := until (int .Values.agent.replicas) -}}
{{- range $i := until (int $.Values.agent.nodesPerReplica) }}
- {{ printf "%s-%d-%d" $base $ordinal $i }}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Cross-field rules JSON Schema cannot state; each failure names the values. */}}
{{- define "nodepulse.validate" -}}
{{- $le := .Values.operator.leaderElection -}}
{{- if not (lt (int $le.retryPeriodSeconds) (int $le.renewDeadlineSeconds)) -}}
{{- fail (printf "operator.leaderElection.retryPeriodSeconds (%v) must be less than renewDeadlineSeconds (%v)" $le.retryPeriodSeconds $le.renewDeadlineSeconds) -}}
{{- end -}}
{{- if not (lt (int $le.renewDeadlineSeconds) (int $le.leaseDurationSeconds)) -}}
{{- fail (printf "operator.leaderElection.renewDeadlineSeconds (%v) must be less than leaseDurationSeconds (%v)" $le.renewDeadlineSeconds $le.leaseDurationSeconds) -}}
{{- end -}}
{{- if .Values.agent.enabled -}}
{{- $total := mul (int .Values.agent.replicas) (int .Values.agent.nodesPerReplica) -}}
{{- if gt $total 10000 -}}
{{- fail (printf "agent.replicas x agent.nodesPerReplica = %d: at most 10000 virtual nodes per release (RBAC names each one)" $total) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Pod and container security settings shared by both programs. */}}
{{- define "nodepulse.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "nodepulse.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
{{- end -}}
